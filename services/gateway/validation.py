"""Checks a GenerateRequest before anything reaches the engine; tokenizes text prompts."""
from __future__ import annotations

import grpc
from loramux.v1 import generate_pb2

from loramux_core.errors import InvalidRequestError
from loramux_core.sampling import sampling_from_proto
from loramux_services.gateway.errors import Rejected, sampling_field

MAX_STOP_STRINGS = 16


def _bad(message: str, field: str) -> Rejected:
    return Rejected(grpc.StatusCode.INVALID_ARGUMENT, message, field)


def check_sampling(pb: generate_pb2.SamplingParams, vocab_size: int) -> None:
    """Raise Rejected(INVALID_ARGUMENT) naming the first sampling field out of range."""
    if len(pb.stop) > MAX_STOP_STRINGS:
        raise _bad(f"sampling.stop has {len(pb.stop)} strings; at most {MAX_STOP_STRINGS}",
                   "sampling.stop")
    try:
        sampling_from_proto(pb).validate(vocab_size or None)
    except InvalidRequestError as err:  # "sampling.<field>=<value>: why", "sampling.<field>: why"
        raise _bad(str(err), sampling_field(str(err)) or "sampling") from None


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of a text prompt, special tokens added by the tokenizer, but BOS never
    twice: a prompt that already starts with the BOS token (text rendered by a chat
    template) keeps only its own."""
    ids = tokenizer.encode(text)
    bos = tokenizer.bos_token_id
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        return ids[1:]
    return ids


def check_prompt_ids(ids: list[int], max_model_len: int) -> None:
    """Rejected when the prompt has no tokens or leaves no room for one generated token
    within the model's limit."""
    if not ids:
        raise _bad("the prompt has no tokens", "prompt")
    if max_model_len and len(ids) >= max_model_len:
        raise _bad(f"the prompt has {len(ids)} tokens; the model's limit is {max_model_len} "
                   "tokens for prompt and output together", "prompt")
