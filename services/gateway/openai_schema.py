"""The OpenAI request bodies the HTTP API accepts (pydantic), and their translation into
GenerateRequests: one per choice, so the HTTP API runs exactly the gRPC path.

Beyond OpenAI's fields, the sampling extensions vLLM accepts are taken too (top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids, include_stop_str_in_output,
return_token_ids; add_generation_prompt and continue_final_message for chats). Fields that
would change results in a way loramux does not implement (penalties, logit_bias, echo,
suffix, tools, ...) are refused with 400 rather than silently ignored."""
from __future__ import annotations

from typing import Any, Literal

from loramux.v1 import generate_pb2
from pydantic import BaseModel, ConfigDict, Field

MAX_CHOICES = 64  # n times the number of prompts


class BadParam(ValueError):
    """A request field that cannot be served: 400 with `param` named."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


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

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for k, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise BadParam(f"messages[{index}].content[{k}]",
                               f"content parts of type {part.type!r} are not supported (text only)")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    def generate_requests(self, adapter: str) -> list[generate_pb2.GenerateRequest]:
        self.check_supported()
        if self.tools or self.tool_choice not in (None, "none"):
            raise BadParam("tools", "tools are not supported")
        if self.response_format and self.response_format.get("type") != "text":
            raise BadParam("response_format", "only response_format type 'text' is supported")
        if self.chat_template_kwargs:
            raise BadParam("chat_template_kwargs", "chat_template_kwargs is not supported")
        if self.top_logprobs and not self.logprobs:
            raise BadParam("top_logprobs", "top_logprobs needs logprobs: true")
        max_tokens = self.max_completion_tokens or self.max_tokens
        pb = self.sampling(max_tokens, self.logprobs, self.top_logprobs or 0)
        chat = generate_pb2.ChatMessages(add_generation_prompt=self.add_generation_prompt,
                                         continue_final_message=self.continue_final_message)
        for i, m in enumerate(self.messages):
            chat.messages.add(role=m.role, content=m.text(i), name=m.name or "")
        return [generate_pb2.GenerateRequest(adapter=adapter, messages=chat,
                                             sampling=self.choice_sampling(pb, j))
                for j in range(self.n)]
