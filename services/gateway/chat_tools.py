"""Tools on /v1/chat/completions: the request's `tools`, `tool_choice` and
`parallel_tool_calls`, the tool calls and results in its history, and what they make of
the request.

The template renders the tools (ChatMessages.tools, the template's `tools`). "auto" leaves
the choice to the model and parses its own call format out of its text (tool_calls.py);
"required" and a named function are enforced: the output is constrained by a JSON schema
built from the tools' parameter schemas, as vLLM does, so their arguments always parse.
Under "auto" a `strict` tool constrains the calls the model writes in its format, and only
them (call_grammar.py). "none" parses nothing."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from loramux.v1 import generate_pb2

from loramux_services.gateway.call_grammar import call_grammar, call_list
from loramux_services.gateway.errors import BadParam
from loramux_services.gateway.structured import Constraint, schema_constraint
from loramux_services.gateway.tool_calls import CallFormat

MAX_TOOLS = 128  # as OpenAI: the "required" schema's size grows with it


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class _FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: _FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict = "{}"

    def text(self) -> str:
        return self.arguments if isinstance(self.arguments, str) else \
            json.dumps(self.arguments, ensure_ascii=False)


class ToolCallIn(BaseModel):
    """A call in an assistant message of the history."""
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


@dataclass(frozen=True)
class ToolPlan:
    """How a choice's output becomes tool calls: mode "auto" (parse `fmt`, the model's
    format; None: do not parse), "required" (the constrained list) or "named" (the output
    is `function`'s arguments). `parallel` False keeps the first call only."""
    mode: str
    function: str = ""
    parallel: bool = True
    fmt: CallFormat | None = None


def tools_json(tools: list[Tool] | None) -> str:
    """ChatMessages.tools: the JSON the template gets as `tools` ("" for none)."""
    if not tools:
        return ""
    return json.dumps([t.model_dump(exclude_none=True) for t in tools], ensure_ascii=False)


def tool_plan(tools: list[Tool] | None, choice: ToolChoice | None,
              parallel: bool) -> ToolPlan | None:
    """None when no tool call can come out (no tools, or "none"); 400 when the choice
    names what the tools do not have."""
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise BadParam("tools", f"tools has {len(tools)} entries; at most {MAX_TOOLS}")
    names = [t.function.name for t in tools]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise BadParam("tools", f"tools: two functions are named {dup!r}")
    choice = choice if choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return None
    if not tools:
        raise BadParam("tool_choice", "tool_choice needs tools to choose from")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise BadParam("tool_choice.function.name", f"tool_choice.function.name: no tool "
                           f"is named {choice.function.name!r}")
        return ToolPlan("named", choice.function.name, parallel)
    return ToolPlan(choice, parallel=parallel)


def tool_constraint(plan: ToolPlan | None, tools: list[Tool] | None) -> Constraint | None:
    """The JSON schema that enforces "required" and a named function (None otherwise)."""
    if plan is None or plan.mode == "auto":
        return None
    if plan.mode == "named":
        i, tool = next((i, t) for i, t in enumerate(tools) if t.function.name == plan.function)
        return schema_constraint(_parameters(tool), f"tools[{i}].function.parameters")
    return schema_constraint(required_schema(tools, plan.parallel), "tools")


def strict_constraint(plan: ToolPlan | None, tools: list[Tool] | None,
                      vocab) -> Constraint | None:
    """Under "auto", once a tool is `strict` and the model's call format is known: the
    grammar that holds every call the model writes to the tools (call_grammar.py), the
    arguments of a tool that is not strict to any JSON object. `vocab`: the tokenizer."""
    if plan is None or plan.mode != "auto" or plan.fmt is None or \
            not any(t.function.strict for t in tools or ()):
        return None
    calls = [(t.function.name, _parameters(t) if t.function.strict else {"type": "object"})
             for t in tools]
    return Constraint(generate_pb2.StructuredOutput(
        grammar=call_grammar(plan.fmt, calls, plan.parallel, vocab)), "tools")


def _parameters(tool: Tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def required_schema(tools: list[Tool], parallel: bool = True) -> dict:
    """A list of at least one {"name": <a tool>, "parameters": <its schema>}."""
    return call_list([(t.function.name, _parameters(t)) for t in tools], "parameters", parallel)
