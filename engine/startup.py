"""Start-up progress of an engine process: the phase it is in (loading the weights,
warming up, serving), what it does now, how far it is and how long it expects still to
take.

The start-up thread reports (`enter`, `advance`); the heartbeat thread reads `snapshot`
at any time (engine/server/loop.py puts it in every heartbeat), so a replica is seen
from the moment its sockets are bound, long before it serves. `ProgressLine` turns the
same reports into one line on stderr every few seconds, for whoever watches the start."""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from loramux_core.v1 import engine_pb2

PHASE_NAMES = {engine_pb2.ENGINE_PHASE_LOADING: "loading",
               engine_pb2.ENGINE_PHASE_WARMING_UP: "warm-up",
               engine_pb2.ENGINE_PHASE_SERVING: "serving"}


@dataclass(frozen=True)
class PhaseSnapshot:
    """What a heartbeat says of the start-up (Heartbeat.phase, phase_detail, ...)."""
    phase: int            # engine_pb2.EnginePhase
    detail: str           # "capturing decode graphs 30/56"
    progress: float       # 0-1 of the phase
    eta_s: float          # seconds the phase still expects to take; negative: unknown
    updated: float        # monotonic time of the last report


class StartupProgress:
    """The engine's phase and its progress, reported by the start-up thread and read from
    any thread. `on_update` runs on the reporting thread after each report."""

    def __init__(self, on_update: Callable[[PhaseSnapshot], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._on_update = on_update
        self._lock = threading.Lock()
        self._phase_start = clock()
        self._state = PhaseSnapshot(engine_pb2.ENGINE_PHASE_LOADING, "starting", 0.0, -1.0,
                                    self._phase_start)
        self.seconds: dict[str, float] = {}  # phase name -> seconds spent in it, once left

    def enter(self, phase: int, detail: str) -> None:
        """A new phase begins (the one before it ends now)."""
        now = self._clock()
        with self._lock:
            name = PHASE_NAMES[self._state.phase]
            self.seconds[name] = self.seconds.get(name, 0.0) + now - self._phase_start
            self._phase_start = now
            self._state = PhaseSnapshot(phase, detail, 0.0, -1.0, now)
        self._notify()

    def advance(self, detail: str, fraction: float) -> None:
        """`fraction` (0-1) of the current phase is done; the estimate of what is left
        assumes the rest goes at the rate so far."""
        now = self._clock()
        fraction = min(1.0, max(0.0, fraction))
        with self._lock:
            elapsed = now - self._phase_start
            eta = elapsed * (1.0 - fraction) / fraction if fraction > 0 else -1.0
            self._state = PhaseSnapshot(self._state.phase, detail, fraction, eta, now)
        self._notify()

    def snapshot(self) -> PhaseSnapshot:
        with self._lock:
            return self._state

    def _notify(self) -> None:
        if self._on_update is not None:
            self._on_update(self.snapshot())


class ProgressLine:
    """Prints a phase's progress as one line on `stream` when it moved by `every_fraction`
    or `every_s` passed since the last line, and when a phase begins:
    `engine warm-up: capturing decode graphs 30/56, 54% of warm-up, about 21 s left`."""

    def __init__(self, stream: TextIO | None = None, every_s: float = 5.0,
                 every_fraction: float = 0.1, clock: Callable[[], float] = time.monotonic):
        self._stream = stream
        self._every_s, self._every_fraction, self._clock = every_s, every_fraction, clock
        self._last: tuple[int, float, float] | None = None  # phase, progress, time printed

    def __call__(self, snap: PhaseSnapshot) -> None:
        if snap.phase == engine_pb2.ENGINE_PHASE_SERVING:
            return  # the server's own line says it serves, with its addresses
        now = self._clock()
        last = self._last
        if (last is not None and snap.phase == last[0] and snap.progress < 1.0
                and snap.progress - last[1] < self._every_fraction - 1e-9  # (rounding)
                and now - last[2] < self._every_s):
            return
        self._last = (snap.phase, snap.progress, now)
        print(progress_text(snap), file=self._stream or sys.stderr, flush=True)


def progress_text(snap: PhaseSnapshot) -> str:
    name = PHASE_NAMES.get(snap.phase, "start-up")
    text = f"engine {name}: {snap.detail}"
    if snap.progress > 0:
        text += f", {snap.progress:.0%} of {name}"
    if snap.eta_s >= 0:
        text += f", about {snap.eta_s:.0f} s left"
    return text
