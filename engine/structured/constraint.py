"""One constrained sequence's matcher, from the compile it waits for to its last token.

A `Constraint` lives on its Request (`Request.grammar`) and so follows it wherever the
request goes: preemption and recompute (the KV is recomputed from the request's tokens;
the matcher has already accepted them and is not touched), prefix reuse (the matcher is
per request, the cache per token), n > 1 (one Constraint per sequence, one compile per
request). Its life:

    waiting ──settle()──▶ bound (matcher = copy of the compiled one, resumed tokens replayed)
        └─────settle()──▶ failed (the library refused it, or it missed the time bound)
    bound ──accept(token) for every sampled token──▶ ... ──▶ stopped (only EOS was left)

The scheduler admits a constrained request only once it is bound (`ready`); the engine
settles waiting ones at each step, on the step thread, so no lock is needed.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, wait

from loramux_core.errors import InvalidRequestError, LoramuxError
from loramux_core.structured import StructuredOutput


class GrammarRejectedError(LoramuxError):
    """A sampled token the matcher refused: the mask allowed it, so this is our fault,
    not the request's (gRPC INTERNAL through the per-request error path)."""


class Constraint:
    def __init__(self, structured: StructuredOutput, compiled: Future, timeout_s: float):
        self.structured = structured
        self._compiled = compiled
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self.matcher = None   # llguidance.LLMatcher once bound
        self.error: Exception | None = None

    @property
    def field(self) -> str:
        return f"sampling.structured.{self.structured.kind}"

    @property
    def ready(self) -> bool:
        """Bound: the request may be scheduled."""
        return self.matcher is not None

    @property
    def settled(self) -> bool:
        return self.matcher is not None or self.error is not None

    def settle(self, generated: list[int]) -> bool:
        """Bind the compiled matcher if its compile is done, replaying `generated` (a
        resumed stream's tokens), or fail it (refused, replay rejected, or past the time
        bound). True once settled."""
        if self.settled:
            return True
        if not self._compiled.done():
            if time.monotonic() > self._deadline:
                self.error = InvalidRequestError(
                    f"{self.field}: not compiled within {self._timeout_s:g} s")
            return self.error is not None
        exc = self._compiled.exception()
        if exc is not None:
            self.error = exc
            return True
        matcher = self._compiled.result().deep_copy()
        if generated and not matcher.consume_tokens(list(generated)):
            self.error = InvalidRequestError(
                f"generated_token_ids: the resumed tokens do not match {self.field}: "
                f"{_first_line(matcher.get_error())}")
            return True
        self.matcher = matcher
        return True

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` (and never past the deadline) for the compile."""
        left = min(timeout_s, self._deadline - time.monotonic())
        if left > 0:
            wait([self._compiled], timeout=left)

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token; GrammarRejectedError if the matcher refuses it."""
        if not self.matcher.consume_token(token_id):
            raise GrammarRejectedError(
                f"{self.field}: sampled token {token_id} refused by the matcher: "
                f"{_first_line(self.matcher.get_error())}")

    @property
    def is_stopped(self) -> bool:
        """The document is complete and nothing, not even EOS, may follow."""
        return self.matcher is not None and self.matcher.is_stopped()


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "refused"
