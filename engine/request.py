"""One generation request inside the engine: its tokens and a handful of counters.

Everything else (how many tokens to compute next, whether it is prefilling) is derived.
A request names its adapter only by id (0 = base); the id is fixed at admission, so a
reload of the adapter's name never changes the weights or KV namespace it runs with.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import FinishReason, RequestOutput, StepOutput
from loramux_core.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after its blocks were taken (recompute)
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter_id: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    arrival: int = 0                  # admission order; larger = newer
    parent_id: str | None = None      # set on the n sequences of a request with n > 1
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0      # tokens whose K/V is in the cache
    num_cached_tokens: int = 0        # prompt tokens served by the prefix cache at first run
    num_resumed_cached_tokens: int = 0  # tokens re-matched from the cache after preemptions
    num_preemptions: int = 0
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    detokenizer: Any = None           # IncrementalDetokenizer, set by the engine
    sampling_state: Any = None        # the sampler's per-request state, set by the engine
    # Async scheduling (a step is launched before the previous one's tokens are known):
    num_inflight_tokens: int = 0      # sampled in launched steps, not yet appended
    num_inflight_steps: int = 0       # launched steps holding this request, not yet updated
    sample_row: int = -1              # its row among the newest launched step's samples
    # its sampler reads the token history (repetition penalty): the step that samples it
    # must see its previous token on the host, so async scheduling syncs before it
    needs_history: bool = field(default=False, init=False)
    _tokens: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self):
        self._tokens = list(self.prompt_token_ids)
        self.needs_history = self.params.repetition_penalty != 1.0

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by every generated token (do not mutate)."""
        return self._tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self._tokens[len(self.prompt_token_ids):]

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._tokens) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens whose K/V the next step may compute: known and in-flight ones past
        `num_computed_tokens`; 0 when the in-flight token is known to be the last
        (max_tokens reached), so the request is not scheduled again."""
        total = len(self._tokens) + self.num_inflight_tokens
        if self.num_inflight_tokens and (
                total - len(self.prompt_token_ids) >= self.params.max_tokens):
            return 0
        return total - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self._tokens.append(int(token_id))

    def check_token_stop(self) -> str | None:
        """Finish reason after the last appended token, from token ids alone (stop strings
        are the detokenizer's business), or None."""
        last = self._tokens[-1]
        if last in self.params.stop_token_ids:
            return FinishReason.STOP
        if not self.params.ignore_eos and last in self.eos_token_ids:
            return FinishReason.EOS
        if self.num_output_tokens >= self.params.max_tokens:
            return FinishReason.LENGTH
        return None

    def step_output(self, text_start: int, new_token: bool = True) -> StepOutput:
        """What one step produced for this request: its newest token (unless `new_token`
        is False, e.g. when it ends without one) and the text after `text_start`."""
        want = new_token and (self.params.logprobs or self.params.top_logprobs > 0)
        return StepOutput(
            request_id=self.request_id,
            new_token_ids=[self.all_token_ids[-1]] if new_token else [],
            new_logprobs=[self.logprobs[-1]] if want else [],
            new_top_logprobs=[self.top_logprobs[-1]] if new_token and self.params.top_logprobs
            else [],
            text_delta=self.text[text_start:],
            finished=self.is_finished,
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens)

    def request_output(self) -> RequestOutput:
        """The whole result of a finished request (Engine.generate)."""
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=list(self.prompt_token_ids),
            token_ids=self.output_token_ids, text=self.text, finish_reason=self.finish_reason,
            logprobs=list(self.logprobs), top_logprobs=list(self.top_logprobs),
            num_cached_tokens=self.num_cached_tokens, adapter_id=self.adapter_id)
