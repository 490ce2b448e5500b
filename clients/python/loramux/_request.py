"""Builds Generate and admin requests from plain Python arguments (shared by both clients)."""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import grpc

from loramux.v1 import adapter_admin_pb2, generate_pb2

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                    "max_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs",
                    "top_logprobs", "include_stop_str_in_output")
# constrained decoding: at most one of these (SamplingParams.structured)
STRUCTURED_FIELDS = ("json_schema", "json_object", "regex", "choice", "grammar",
                     "structural_tag")


def generate_request(prompt: str | Sequence[int], adapter: str | None = None,
                     request_id: str = "", **sampling) -> generate_pb2.GenerateRequest:
    """A GenerateRequest; `prompt` is text or a list of token ids, `sampling` takes the
    SamplingParams field names (temperature=0.0, max_tokens=32, stop=["\\n"], ...) and one
    output constraint: json_schema= (a dict or its JSON text), json_object=True, regex=,
    choice=[...], grammar= (Lark text) or structural_tag={"structures": [{"begin",
    "schema", "end"}], "triggers": [...]}."""
    req = generate_pb2.GenerateRequest(adapter=adapter or "", request_id=request_id)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)
    _set_sampling(req, sampling)
    return req


def chat_request(messages: Sequence[Mapping], adapter: str | None = None,
                 request_id: str = "", *, add_generation_prompt: bool | None = None,
                 continue_final_message: bool = False, tools: Sequence[Mapping] | None = None,
                 tool_choice: str | Mapping | None = None, parallel_tool_calls: bool = True,
                 **sampling) -> generate_pb2.GenerateRequest:
    """A GenerateRequest whose prompt is a chat: `messages` are dicts as in the OpenAI API
    ("role", "content", optionally "name", an assistant's "tool_calls", a tool result's
    "tool_call_id"), rendered by the served model's chat template with `tools` (OpenAI
    function tools). `tool_choice` and `parallel_tool_calls` as in the OpenAI API ("auto",
    "none", "required", a function's name or {"type": "function", "function": {"name"}});
    the gateway parses the calls into the last response's tool_calls."""
    req = generate_pb2.GenerateRequest(adapter=adapter or "", request_id=request_id)
    chat = req.messages
    for m in messages:
        _add_message(chat, m)
    if tools:
        chat.tools = json.dumps(list(tools), ensure_ascii=False)
    if isinstance(tool_choice, Mapping):
        tool_choice = tool_choice["function"]["name"]
    chat.tool_choice = tool_choice or ""
    chat.single_tool_call = not parallel_tool_calls
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    chat.continue_final_message = continue_final_message
    _set_sampling(req, sampling)
    return req


def _add_message(chat: generate_pb2.ChatMessages, m: Mapping) -> None:
    calls = m.get("tool_calls") or ()
    msg = chat.messages.add(role=m["role"], name=m.get("name") or "",
                            tool_call_id=m.get("tool_call_id") or "")
    if m.get("content") is not None or not calls:  # no content: only for a turn of calls
        msg.content = m.get("content") or ""
    for call in calls:
        args = call["function"].get("arguments", "{}")
        msg.tool_calls.add(id=call.get("id", ""), name=call["function"]["name"],
                           arguments=args if isinstance(args, str) else json.dumps(args))


def _set_sampling(req: generate_pb2.GenerateRequest, sampling: dict) -> None:
    unknown = set(sampling) - set(_SAMPLING_FIELDS) - set(STRUCTURED_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling argument(s): {sorted(unknown)}")
    given = {k: sampling.pop(k) for k in STRUCTURED_FIELDS if k in sampling}
    structured = {k: v for k, v in given.items() if v is not None and v is not False}
    if structured:
        req.sampling.structured.CopyFrom(structured_output(**structured))
    for name, value in sampling.items():
        if value is None:
            continue
        if name in ("stop", "stop_token_ids"):
            getattr(req.sampling, name).extend(value)
        else:
            setattr(req.sampling, name, value)


def structured_output(**given) -> generate_pb2.StructuredOutput:
    """The StructuredOutput of exactly one of STRUCTURED_FIELDS; its content is checked by
    the gateway (INVALID_ARGUMENT naming sampling.structured.<kind>)."""
    if len(given) != 1:
        raise TypeError(f"give one output constraint of {', '.join(STRUCTURED_FIELDS)}, "
                        f"not {', '.join(sorted(given))}")
    (kind, value), = given.items()
    pb = generate_pb2.StructuredOutput()
    if kind == "json_schema":
        pb.json_schema = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    elif kind == "json_object":
        pb.json_object = True
    elif kind == "choice":
        if isinstance(value, str):
            raise TypeError("choice takes a list of strings, not one string")
        pb.choice.SetInParent()  # set even when empty, so the gateway says what is wrong
        pb.choice.choices.extend(value)
    elif kind == "structural_tag":
        pb.structural_tag.SetInParent()
        pb.structural_tag.triggers.extend(value.get("triggers", ()))
        for s in value.get("structures", ()):
            schema = s.get("schema", "")
            pb.structural_tag.structures.add(
                begin=s["begin"], end=s["end"],
                json_schema=schema if isinstance(schema, str) else json.dumps(schema))
    else:
        setattr(pb, kind, value)
    return pb


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
