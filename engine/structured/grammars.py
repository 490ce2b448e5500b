"""The engine's structured decoding: what it asks of the grammar parts, on the step thread.

- `attach(req)` at admission: the request's constraint (one per sequence) starts
  compiling, or finds its compile cached; the scheduler holds the request back until it
  is bound (Constraint.ready); other requests are scheduled as usual meanwhile.
- `settle()` before each schedule: compiles that finished bind their matchers; those
  refused or past the bound come back for the engine to finish with their error.
- `fill(requests)` while a step's forward pass runs: the constrained rows' bitmask.
- `accept(req)` when a step's token is appended: the matcher advances with it.
"""
from __future__ import annotations

from loramux_engine.outputs import FinishReason
from loramux_engine.request import Request
from loramux_engine.structured.compiler import CompilerConfig, GrammarCompiler
from loramux_engine.structured.constraint import Constraint, GrammarRejectedError
from loramux_engine.structured.masks import TokenMasks

# how long a request may wait for its compile (the library's own limits bound the work)
COMPILE_TIMEOUT_S = 10.0


class Grammars:
    def __init__(self, cfg: CompilerConfig, max_rows: int, pin: bool):
        self.compiler = GrammarCompiler(cfg)
        self.masks = TokenMasks(cfg.vocab_size, max_rows, pin)
        self.timeout_s = COMPILE_TIMEOUT_S  # a request's wait for its compile, at most
        self._waiting: list[Request] = []

    def attach(self, req: Request) -> None:
        """Start (or find cached) the compile of `req`'s constraint, if it has one."""
        s = req.params.structured
        if s is None:
            return
        req.grammar = Constraint(s, self.compiler.submit(s), self.timeout_s)
        self._waiting.append(req)

    def settle(self) -> list[Request]:
        """Bind the constraints whose compile finished (replaying a resumed request's
        tokens); returns the requests whose constraint failed (`grammar.error`)."""
        failed, still = [], []
        for req in self._waiting:
            if req.is_finished:   # aborted while compiling
                continue
            if not req.grammar.settle(req.output_token_ids):
                still.append(req)
            elif req.grammar.error is not None:
                failed.append(req)
        self._waiting = still
        return failed

    def wait(self, timeout_s: float) -> bool:
        """Nothing else can run: wait up to `timeout_s` for the oldest compile. False if
        no request waits for one."""
        live = [r for r in self._waiting if not r.is_finished]
        if not live:
            return False
        live[0].grammar.wait(timeout_s)
        return True

    def fill(self, requests: list[Request]):
        """The bitmask of the constrained rows among a step's sampling requests
        (TokenMasks.fill)."""
        return self.masks.fill(requests)

    @staticmethod
    def accept(req: Request, reason: str | None) -> tuple[str | None, Exception | None]:
        """Advance `req`'s matcher with its newest token, given the finish reason the
        output processor found: (finish reason, error). A refused token is an ERROR of
        this request alone; a document that admits nothing more ends it (STOP) even when
        EOS is ignored."""
        try:
            req.grammar.accept(req.all_token_ids[-1])
        except GrammarRejectedError as exc:
            return FinishReason.ERROR, exc
        if reason is None and req.grammar.is_stopped:
            reason = FinishReason.STOP
        return reason, None

    def close(self) -> None:
        self.compiler.close()
