"""Tools over gRPC, as the HTTP API has them (chat_tools.py): ChatMessages.tool_choice and
single_tool_call are OpenAI's tool_choice and parallel_tool_calls, with the same
constraints ("required", a named function, a strict tool under "auto"), and the calls
parsed out of the whole output go into the last GenerateResponse's tool_calls (`text`
stays the output as written). A refusal names the ChatMessages field at fault."""
from __future__ import annotations

import dataclasses

import grpc
from loramux.v1 import generate_pb2
from pydantic import TypeAdapter, ValidationError

from loramux_services.gateway.chat_tools import (NamedToolChoice, Tool, strict_constraint,
                                                 tool_constraint, tool_plan)
from loramux_services.gateway.errors import BadParam, Rejected
from loramux_services.gateway.structured import renamed
from loramux_services.gateway.tool_output import ChoiceTools

_TOOLS = TypeAdapter(list[Tool])


class CallsOut:
    """One call's output, gathered until its last response gets the calls."""

    def __init__(self, tools: ChoiceTools, field: str | None):
        self.tools = tools
        self.field = field  # the ChatMessages field whose constraint the output is under
        self._text: list[str] = []

    def refusal(self, err: Rejected) -> Rejected:
        """An engine's refusal of the constraint the tools set, told about their field."""
        if self.field is None or not (err.field or "").startswith("sampling.structured"):
            return err
        return Rejected(err.code, renamed(str(err), err.field, self.field), field=self.field)

    def add(self, resp: generate_pb2.GenerateResponse) -> None:
        self._text.append(resp.text)
        if resp.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
            _, calls = self.tools.whole("".join(self._text))
            resp.tool_calls.extend(generate_pb2.ToolCall(id=c.id, name=c.name,
                                                         arguments=c.arguments) for c in calls)


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
