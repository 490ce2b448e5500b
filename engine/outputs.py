"""What the engine hands back: per-step deltas and finished request outputs."""
from __future__ import annotations

from dataclasses import dataclass, field


class FinishReason:
    LENGTH = "length"
    STOP = "stop"  # a stop string or a stop token id
    EOS = "eos"
    ABORTED = "aborted"
    ERROR = "error"


@dataclass
class StepOutput:
    """New tokens of one request produced by one engine step (what the server streams)."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    text_delta: str = ""
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: Exception | None = None  # why a request finished with ERROR, when it says


@dataclass
class RequestOutput:
    """A finished request, as `Engine.generate` returns it."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_cached_tokens: int = 0
    adapter_id: int = 0
