"""Builds Generate and admin requests from plain Python arguments (shared by both clients)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import grpc

from loramux.v1 import adapter_admin_pb2, generate_pb2

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                    "max_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs",
                    "top_logprobs", "include_stop_str_in_output")


def generate_request(prompt: str | Sequence[int], adapter: str | None = None,
                     request_id: str = "", **sampling) -> generate_pb2.GenerateRequest:
    """A GenerateRequest; `prompt` is text or a list of token ids, `sampling` takes the
    SamplingParams field names (temperature=0.0, max_tokens=32, stop=["\\n"], ...)."""
    req = generate_pb2.GenerateRequest(adapter=adapter or "", request_id=request_id)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)
    _set_sampling(req, sampling)
    return req


def chat_request(messages: Sequence[Mapping[str, str]], adapter: str | None = None,
                 request_id: str = "", *, add_generation_prompt: bool | None = None,
                 continue_final_message: bool = False,
                 **sampling) -> generate_pb2.GenerateRequest:
    """A GenerateRequest whose prompt is a chat: `messages` are dicts with "role" and
    "content" (and optionally "name"), rendered by the served model's chat template."""
    req = generate_pb2.GenerateRequest(adapter=adapter or "", request_id=request_id)
    chat = req.messages
    for m in messages:
        chat.messages.add(role=m["role"], content=m.get("content") or "", name=m.get("name") or "")
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    chat.continue_final_message = continue_final_message
    _set_sampling(req, sampling)
    return req


def _set_sampling(req: generate_pb2.GenerateRequest, sampling: dict) -> None:
    unknown = set(sampling) - set(_SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling argument(s): {sorted(unknown)}")
    for name, value in sampling.items():
        if value is None:
            continue
        if name in ("stop", "stop_token_ids"):
            getattr(req.sampling, name).extend(value)
        else:
            setattr(req.sampling, name, value)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the admin bearer token (none when token is empty)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class LoadResult(NamedTuple):
    """One item of a batch load: `code` OK with the `adapter`, or the status that refused
    this item alone and its `message`."""
    name: str
    code: grpc.StatusCode
    message: str
    adapter: adapter_admin_pb2.Adapter | None


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def load_many_request(items: Iterable) -> adapter_admin_pb2.LoadAdaptersRequest:
    """A LoadAdaptersRequest of `items`: (name, path) pairs, or mappings of load_request's
    arguments ({"name": ..., "path": ..., "pinned": ..., "replicas": ...})."""
    return adapter_admin_pb2.LoadAdaptersRequest(items=[
        load_request(**item) if isinstance(item, Mapping) else load_request(*item)
        for item in items])


def load_results(req, resp) -> list[LoadResult]:
    return [LoadResult(item.name, _CODES.get(r.code, grpc.StatusCode.UNKNOWN), r.message,
                       r.adapter if r.code == 0 else None)
            for item, r in zip(req.items, resp.results)]


def load_request(name: str, path: str | None = None, pinned: bool | None = None,
                 replicas=None) -> adapter_admin_pb2.LoadAdapterRequest:
    """A LoadAdapterRequest; `pinned` None leaves the adapter's pin as it is; `replicas`
    (engine replica indexes) None places it on every replica, or keeps its placement."""
    req = adapter_admin_pb2.LoadAdapterRequest(name=name, replicas=list(replicas or ()))
    if path is not None:
        req.path = path
    if pinned is not None:
        req.pinned = pinned
    return req
