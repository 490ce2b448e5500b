"""Tools over gRPC, as the HTTP API has them (chat_tools.py): ChatMessages.tool_choice and
single_tool_call are OpenAI's tool_choice and parallel_tool_calls, with the same
constraints ("required", a named function, a strict tool under "auto"), and the calls
parsed out of the whole output go into the last GenerateResponse's tool_calls (`text`
stays the output as written). A refusal names the ChatMessages field at fault. Also, a
structural tag in SamplingParams.structured becomes its grammar here."""
from __future__ import annotations

import dataclasses

import grpc
from loramux.v1 import generate_pb2
from pydantic import TypeAdapter, ValidationError

from loramux_services.gateway.chat_tools import (NamedToolChoice, Tool, strict_constraint,
                                                 tool_constraint, tool_plan)
from loramux_services.gateway.errors import BadParam, Rejected
from loramux_services.gateway.structured import renamed, structural_tag
from loramux_services.gateway.tool_output import ChoiceTools

_TOOLS = TypeAdapter(list[Tool])


class CallsOut:
    """One call's output, gathered until its last response gets the calls."""

    def __init__(self, tools: ChoiceTools, field: str | None):
        self.tools = tools
        self.field = field  # the ChatMessages field whose constraint the output is under
        self._text: list[str] = []

    def add(self, resp: generate_pb2.GenerateResponse) -> None:
        self._text.append(resp.text)
        if resp.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
            _, calls = self.tools.whole("".join(self._text))
            resp.tool_calls.extend(generate_pb2.ToolCall(id=c.id, name=c.name,
                                                         arguments=c.arguments) for c in calls)


def expand_tag(sampling: generate_pb2.SamplingParams) -> str | None:
    """A structural tag becomes the grammar that holds it (in place), as over HTTP; the
    field it came from, or None when there is none."""
    if sampling.structured.WhichOneof("kind") != "structural_tag":
        return None
    tag = sampling.structured.structural_tag
    field = "sampling.structured.structural_tag"
    spec = {"triggers": list(tag.triggers), "structures": [
        {"begin": s.begin, "end": s.end, "schema": s.json_schema or True}
        for s in tag.structures]}
    try:
        sampling.structured.grammar = structural_tag(spec, field).structured.grammar
    except BadParam as err:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(err), field=err.param) from None
    return field


def refused_as(err: Rejected, field: str | None) -> Rejected:
    """An engine's refusal of a constraint the gateway wrote, told about `field`, the one
    the caller sent."""
    if field is None or not (err.field or "").startswith("sampling.structured"):
        return err
    return Rejected(err.code, renamed(str(err), err.field, field), field=field)


async def calls_for(request: generate_pb2.GenerateRequest, call_format, vocab) -> CallsOut | None:
    """What the request's tools make of it: its output constrained where the choice asks
    (request.sampling.structured set in place), and how its calls are parsed; None when
    none can come out. `call_format(adapter)`: the model's call format (awaitable)."""
    chat = request.messages if request.WhichOneof("prompt") == "messages" else None
    if chat is None or (not chat.tools and chat.tool_choice in ("", "none")):
        return None
    try:
        tools = _TOOLS.validate_json(chat.tools or "[]")
    except ValidationError as err:
        where = ".".join(str(p) for p in err.errors()[0]["loc"])
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"messages.tools: {where}: "
                       f"{err.errors()[0]['msg']}", field="messages.tools") from None
    choice = chat.tool_choice or None
    if choice not in (None, "auto", "none", "required"):
        choice = NamedToolChoice(type="function", function={"name": choice})
    try:
        plan = tool_plan(tools, choice, not chat.single_tool_call)
        if plan is None:
            return None
        if plan.mode == "auto":
            plan = dataclasses.replace(plan, fmt=await call_format(request.adapter))
        constraint = tool_constraint(plan, tools) or strict_constraint(plan, tools, vocab)
    except BadParam as err:  # tool_choice is the function's name here
        param, message = (str(x).replace("tool_choice.function.name", "tool_choice")
                          for x in (err.param, err))
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"messages.{message}",
                       field=f"messages.{param}") from None
    field = None
    if constraint is not None:
        if not request.sampling.HasField("structured"):
            request.sampling.structured.CopyFrom(constraint.structured)
            field = f"messages.{constraint.param.split('[')[0]}"
        elif plan.mode != "auto":  # under "auto" the constraint asked for wins
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"messages.tool_choice {plan.mode!r} constrains the output, and "
                           "so does sampling.structured; give one",
                           field="messages.tool_choice")
    return CallsOut(ChoiceTools(plan), field)
