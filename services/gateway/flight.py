"""One request in flight through the gateway: what it takes to send it again.

A replica that dies takes its requests' state with it; the gateway keeps, per request,
the prompt ids, adapter, sampling parameters and every token id it handed to the caller.
From those the same request can be sent to another replica: again as it was (no token
yet: re-sent), or with the tokens already delivered as generated context (resumed: the
engine counts them against max_tokens, in stop checks and in sampling positions, and
sends only what follows them, engine/output_processor.py)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from loramux.v1 import generate_pb2

from loramux_core.v1 import engine_pb2

RESENT, RESUMED = "resent", "resumed"


@dataclass(eq=False)
class Flight:
    """`handle`: the id the caller holds (open/submit/release); `engine_rid`: the id of
    the current attempt on `replica` (a new one per attempt, so a replica that was only
    silent, not dead, can never mix an old attempt's tokens into the stream)."""
    handle: str
    queue: asyncio.Queue
    adapter: str
    placement: tuple[int, ...]
    replica: object | None = None        # the Replica running it; None while stranded
    engine_rid: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    sampling: generate_pb2.SamplingParams | None = None
    generated: list[int] = field(default_factory=list)  # token ids handed to the caller
    attempts: int = 0
    down_reason: str = ""                # why the last replica was lost
    deadline: float = 0.0                # stranded: when the call gives up (loop time)

    @property
    def submitted(self) -> bool:
        return self.sampling is not None

    @property
    def kind(self) -> str:
        """What sending it again is: RESENT (nothing delivered yet) or RESUMED."""
        return RESUMED if self.generated else RESENT

    def next_attempt(self) -> str:
        """A fresh engine request id for the next attempt."""
        self.attempts += 1
        self.engine_rid = self.handle if self.attempts == 1 else f"{self.handle}~{self.attempts}"
        return self.engine_rid

    def message(self) -> engine_pb2.EngineInput:
        """The EngineGenerate of the current attempt."""
        return engine_pb2.EngineInput(generate=engine_pb2.EngineGenerate(
            request_id=self.engine_rid, prompt_token_ids=self.prompt_ids,
            adapter=self.adapter, sampling=self.sampling,
            generated_token_ids=self.generated))
