"""One generation request inside the engine: its tokens and a handful of counters.

Everything else (how many tokens to compute next, whether it is prefilling) is derived.
A request names its adapter only by id (0 = base); the id is fixed at admission, so a
reload of the adapter's name never changes the weights or KV namespace it runs with.
What its caller sees (text, logprobs) and when it stops is the output processor's
(engine/output_processor.py); the scheduler only appends its tokens.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

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
    arrival: int = 0                  # admission order; larger = newer
    parent_id: str | None = None      # set on the n sequences of a request with n > 1
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0      # tokens whose K/V is in the cache
    num_cached_tokens: int = 0        # prompt tokens served by the prefix cache at first run
    num_resumed_cached_tokens: int = 0  # tokens re-matched from the cache after preemptions
    num_preemptions: int = 0
    finish_reason: str | None = None
    sampling_state: Any = None        # the sampler's per-request state, set by the engine
    grammar: Any = None               # its constraint's matcher (engine/structured/), or None
    output: Any = None                # what the caller sees (engine/output_processor.py)
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
