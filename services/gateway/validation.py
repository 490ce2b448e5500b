"""Checks a GenerateRequest before anything reaches the engine; tokenizes text prompts."""
from __future__ import annotations

import grpc
from loramux.v1 import generate_pb2

from engine.errors import InvalidRequestError
from engine.server.convert import sampling_from_proto
from services.gateway.errors import Rejected

MAX_STOP_STRINGS = 16


def _bad(message: str) -> Rejected:
    return Rejected(grpc.StatusCode.INVALID_ARGUMENT, message)


def check_sampling(pb: generate_pb2.SamplingParams, vocab_size: int) -> None:
    """Raise Rejected(INVALID_ARGUMENT) naming the first sampling field out of range."""
    if len(pb.stop) > MAX_STOP_STRINGS:
        raise _bad(f"sampling.stop has {len(pb.stop)} strings; at most {MAX_STOP_STRINGS}")
    try:
        sampling_from_proto(pb).validate(vocab_size or None)
    except InvalidRequestError as err:
        raise _bad(str(err)) from None


def prompt_ids(req: generate_pb2.GenerateRequest, tokenizer, max_model_len: int,
               vocab_size: int) -> list[int]:
    """The prompt's token ids; Rejected when it is empty, has ids outside the vocabulary,
    or leaves no room for one generated token within the model's limit."""
    which = req.WhichOneof("prompt")
    if which == "text":
        if not req.text:
            raise _bad("prompt text is empty")
        ids = tokenizer.encode(req.text)
    elif which == "token_ids":
        ids = list(req.token_ids.ids)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise _bad(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    else:
        raise _bad("the request has no prompt (set text or token_ids)")
    if not ids:
        raise _bad("the prompt has no tokens")
    if max_model_len and len(ids) >= max_model_len:
        raise _bad(f"the prompt has {len(ids)} tokens; the model's limit is {max_model_len} "
                   "tokens for prompt and output together")
    return ids
