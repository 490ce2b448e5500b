"""One chat choice's output as content and tool calls, whole or as OpenAI's stream deltas.

A streamed call comes as OpenAI sends one: a delta with its index, id, type and
function.name (arguments ""), then deltas of function.arguments. Calls parsed from the
model's own format are sent once each is whole; a named function's arguments are the
constrained output itself, so they stream piece by piece as generated."""
from __future__ import annotations

from loramux_services.gateway.chat_tools import ToolPlan
from loramux_services.gateway.tool_calls import (REQUIRED, CallParser, ToolCall, new_call_id,
                                                 parse_all)


class ChoiceTools:
    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.fmt = REQUIRED if plan.mode == "required" else plan.fmt
        self._parser = CallParser(self.fmt) if self.fmt is not None else None
        self._named_id = new_call_id() if plan.mode == "named" else ""
        self.sent = 0  # calls streamed so far

    @property
    def parses(self) -> bool:
        """Whether this output can hold tool calls at all."""
        return self.plan.mode == "named" or self._parser is not None

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of the whole output; content None when there are calls and
        no other text, as OpenAI sends it."""
        if self.plan.mode == "named":
            return None, [ToolCall(self._named_id, self.plan.function, text)]
        if self._parser is None:
            return text, []
        content, calls = parse_all(self.fmt, text)
        calls = calls if self.plan.parallel else calls[:1]
        return (content if content.strip() or not calls else None), calls

    def feed(self, text: str) -> list[dict]:
        """The deltas a piece of the output makes (maybe none: held back)."""
        if self.plan.mode == "named":
            return self._named(text)
        if self._parser is None:
            return [{"content": text}] if text else []
        return self._deltas(*self._parser.feed(text))

    def finish(self) -> list[dict]:
        if self._parser is None:
            return []
        return self._deltas(*self._parser.finish())

    def _named(self, text: str) -> list[dict]:
        out = []
        if not self.sent:
            self.sent = 1
            out.append(_call_head(0, ToolCall(self._named_id, self.plan.function, "")))
        if text:
            out.append(_arguments(0, text))
        return out

    def _deltas(self, content: str, calls: list[ToolCall]) -> list[dict]:
        out = [{"content": content}] if content else []
        for call in calls:
            if self.sent and not self.plan.parallel:
                break  # parallel_tool_calls false: the first call only
            out += [_call_head(self.sent, call), _arguments(self.sent, call.arguments)]
            self.sent += 1
        return out


def _call_head(index: int, call: ToolCall) -> dict:
    return {"tool_calls": [{"index": index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": ""}}]}


def _arguments(index: int, text: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}
