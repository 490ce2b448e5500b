"""Request admission: everything `Engine.add_request` checks before anything is queued,
and the sequence ids of a request with n > 1.

Every check raises a typed error (loramux_core/errors.py) that says what is wrong and where;
none of them changes engine state, so a refused request leaves the engine as it was.
"""
from __future__ import annotations

from dataclasses import dataclass

from loramux_core.errors import InvalidRequestError, PromptTooLongError
from loramux_core.sampling import SamplingParams
from loramux_core.tokenizer import Tokenizer


@dataclass(frozen=True)
class AdmissionLimits:
    """What bounds a request: the vocabulary, the context length and the KV pool."""
    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int

    @property
    def kv_capacity(self) -> int:
        """Tokens the whole KV pool holds: no single sequence can be longer."""
        return self.num_kv_blocks * self.block_size


def check_request(request_id, params, limits: AdmissionLimits) -> None:
    """The request id is a non-empty string and `params` valid SamplingParams."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError(f"request_id={request_id!r}: must be a non-empty string")
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(
            f"sampling params must be a SamplingParams, got {type(params).__name__}")
    params.validate(limits.vocab_size)


def prompt_token_ids(prompt, tokenizer: Tokenizer, limits: AdmissionLimits) -> list[int]:
    """The prompt's token ids: a string is encoded, a list of ids is range-checked."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
        vocab = limits.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"prompt token {i}: {t!r} is not a token id in [0, {vocab})")
    else:
        raise InvalidRequestError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise InvalidRequestError("prompt is empty: at least one token is needed")
    return ids


def check_length(num_prompt: int, max_tokens: int, limits: AdmissionLimits) -> None:
    """Prompt plus max_tokens fits both the model's context and the KV pool."""
    total = num_prompt + max_tokens
    if total > limits.max_model_len:
        raise PromptTooLongError(
            f"prompt has {num_prompt} tokens and max_tokens={max_tokens}: {total} > "
            f"max_model_len={limits.max_model_len}")
    if total > limits.kv_capacity:
        raise PromptTooLongError(
            f"prompt has {num_prompt} tokens and max_tokens={max_tokens}: {total} > "
            f"KV cache capacity of {limits.kv_capacity} tokens ({limits.num_kv_blocks} blocks)")


def check_generated(generated, params: SamplingParams, limits: AdmissionLimits) -> list[int]:
    """A resumed request's tokens already generated (Engine.add_request): token ids, fewer
    than max_tokens (a request that had all of them was finished), one sequence only. The
    length was checked with the prompt and max_tokens: they are part of that budget."""
    ids = list(generated)
    if not ids:
        return ids
    if params.n != 1:
        raise InvalidRequestError(f"generated tokens with n={params.n}: only a single "
                                  "sequence resumes")
    if len(ids) >= params.max_tokens:
        raise InvalidRequestError(f"{len(ids)} generated tokens: a resumed request has fewer "
                                  f"than max_tokens={params.max_tokens}")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limits.vocab_size:
            raise InvalidRequestError(
                f"generated token {i}: {t!r} is not a token id in [0, {limits.vocab_size})")
    return ids


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's sequences: the id itself, or "<id>/<i>" for each of n > 1
    (they inherit the adapter id and share the prompt's full blocks through the prefix
    cache: same namespace, same tokens)."""
    return [request_id] if n == 1 else [f"{request_id}/{i}" for i in range(n)]
