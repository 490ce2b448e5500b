"""The OpenAI request bodies the HTTP API accepts (pydantic), and their translation into
GenerateRequests: one per choice, so the HTTP API runs exactly the gRPC path.

Beyond OpenAI's fields, the sampling extensions vLLM accepts are taken too (top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids, include_stop_str_in_output,
return_token_ids, structured_outputs and the older guided_* fields; add_generation_prompt
and continue_final_message for chats). Fields that would change results in a way loramux
does not implement (penalties, logit_bias, echo, suffix, ...) are refused with 400 rather
than silently ignored. Output constraints: structured.py; tools: chat_tools.py."""
from __future__ import annotations

from typing import Literal

from loramux.v1 import generate_pb2
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from loramux_services.gateway.chat_tools import (Tool, ToolCallIn, ToolChoice, ToolPlan,
                                                 tool_constraint, tool_plan, tools_json)
from loramux_services.gateway.errors import BadParam
from loramux_services.gateway.structured import GUIDED, Constraint, constraint_of

MAX_CHOICES = 64  # n times the number of prompts


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """Fields common to completions and chat completions."""
    model_config = ConfigDict(extra="forbid")
    model: str
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    # output constraints (structured.py)
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # the constraint generate_requests chose: its refusals name its field
    _constraint: Constraint | None = PrivateAttr(default=None)

    @property
    def constraint_param(self) -> str | None:
        return self._constraint.param if self._constraint is not None else None

    def output_constraint(self) -> Constraint | None:
        return constraint_of(self.response_format, self.structured_outputs,
                             {k: getattr(self, k) for k in GUIDED})

    def check_supported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise BadParam(name, f"{name} is not supported (use repetition_penalty)")
        if self.logit_bias:
            raise BadParam("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise BadParam("stream_options", "stream_options is only allowed when stream is true")

    def sampling(self, max_tokens: int | None, logprobs: bool,
                 top_logprobs: int) -> generate_pb2.SamplingParams:
        pb = generate_pb2.SamplingParams(ignore_eos=self.ignore_eos, logprobs=logprobs,
                                         top_logprobs=top_logprobs,
                                         include_stop_str_in_output=self.include_stop_str_in_output)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed"):
            if (value := getattr(self, name)) is not None:
                setattr(pb, name, value)
        if max_tokens is not None:
            pb.max_tokens = max_tokens
        pb.stop.extend([self.stop] if isinstance(self.stop, str) else self.stop or [])
        pb.stop_token_ids.extend(self.stop_token_ids or [])
        if self._constraint is not None:
            pb.structured.CopyFrom(self._constraint.structured)
        return pb

    def choice_sampling(self, pb: generate_pb2.SamplingParams,
                        index: int) -> generate_pb2.SamplingParams:
        """Choice `index` of n: with a seed, each choice draws from seed + index, so the n
        choices differ and the request stays reproducible."""
        if self.seed is None or index == 0:
            return pb
        out = generate_pb2.SamplingParams()
        out.CopyFrom(pb)
        out.seed = (self.seed + index) % (1 << 63)
        return out


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]
        if not p:
            raise BadParam("prompt", "prompt is empty")
        return list(p)

    def generate_requests(self, adapter: str) -> list[generate_pb2.GenerateRequest]:
        """One GenerateRequest per choice: prompt i, sample j at index i * n + j."""
        self.check_supported()
        if self.echo:
            raise BadParam("echo", "echo is not supported")
        if self.suffix:
            raise BadParam("suffix", "suffix is not supported")
        if self.best_of not in (None, 1, self.n):
            raise BadParam("best_of", "best_of must equal n")
        prompts = self.prompts()
        self._constraint = self.output_constraint()
        if len(prompts) * self.n > MAX_CHOICES:
            raise BadParam("n", f"{len(prompts)} prompts x n={self.n} choices; at most {MAX_CHOICES}")
        pb = self.sampling(self.max_tokens, self.logprobs is not None, self.logprobs or 0)
        out = []
        for prompt in prompts:
            for j in range(self.n):
                req = generate_pb2.GenerateRequest(adapter=adapter,
                                                   sampling=self.choice_sampling(pb, j))
                if isinstance(prompt, str):
                    req.text = prompt
                else:
                    req.token_ids.ids.extend(prompt)
                out.append(req)
        return out


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None             # a tool turn: the call it answers

    def text(self, index: int) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        parts = []
        for k, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise BadParam(f"messages[{index}].content[{k}]",
                               f"content parts of type {part.type!r} are not supported (text only)")
            parts.append(part.text)
        return "".join(parts)

    def add_to(self, chat: generate_pb2.ChatMessages, index: int) -> None:
        m = chat.messages.add(role=self.role, name=self.name or "",
                              tool_call_id=self.tool_call_id or "")
        text = self.text(index)
        if text is not None or not self.tool_calls:  # no content: only for a turn of calls
            m.content = text or ""
        for call in self.tool_calls or ():
            m.tool_calls.add(id=call.id, name=call.function.name, arguments=call.function.text())


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # how each choice's output becomes tool calls (None: it never does)
    _tool_plan: ToolPlan | None = PrivateAttr(default=None)

    @property
    def plan(self) -> ToolPlan | None:
        return self._tool_plan

    def generate_requests(self, adapter: str) -> list[generate_pb2.GenerateRequest]:
        self.check_supported()
        if self.chat_template_kwargs:
            raise BadParam("chat_template_kwargs", "chat_template_kwargs is not supported")
        if self.top_logprobs and not self.logprobs:
            raise BadParam("top_logprobs", "top_logprobs needs logprobs: true")
        self._constraint = self._choose_constraint()
        max_tokens = self.max_completion_tokens or self.max_tokens
        pb = self.sampling(max_tokens, self.logprobs, self.top_logprobs or 0)
        chat = generate_pb2.ChatMessages(add_generation_prompt=self.add_generation_prompt,
                                         continue_final_message=self.continue_final_message,
                                         tools=tools_json(self.tools))
        for i, m in enumerate(self.messages):
            m.add_to(chat, i)
        return [generate_pb2.GenerateRequest(adapter=adapter, messages=chat,
                                             sampling=self.choice_sampling(pb, j))
                for j in range(self.n)]

    def _choose_constraint(self) -> Constraint | None:
        """The tool choice's constraint, or the one the output fields ask for: not both."""
        self._tool_plan = tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls)
        by_tools = tool_constraint(self._tool_plan, self.tools)
        asked = self.output_constraint()
        if by_tools is not None and asked is not None:
            raise BadParam("tool_choice", f"tool_choice {self._tool_plan.mode!r} constrains the "
                           f"output, and so does {asked.param}; give one")
        return by_tools or asked
