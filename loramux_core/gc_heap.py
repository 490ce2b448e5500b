"""A long-running process's start-up heap, kept out of CPython's cyclic collector.

A full (generation 2) collection walks every tracked object in the process. A serving
process holds hundreds of thousands made at start-up that live until it exits (modules,
the model, compiled kernels, CUDA graphs, the tokenizer), and a full collection walks all
of them: tens to hundreds of milliseconds during which the engine's step thread (or a
service's event loop) stands still, so one decode step's time to the next token jumps by
that much. Such a collection starts when the objects promoted to the oldest generation
since the last one exceed a quarter of what that one found. Under async scheduling a
decode step's per-request objects (scheduled entries, sampled tokens, outputs) live until
the next step completes: at batch 256 they cross the youngest generation's threshold
(700) about twice a step and about 160 a step are promoted, so a full collection comes
every few hundred steps; at batch 64 a step stays under the threshold and promotes none
(measured on the CPU with a tiny model: benchmarks/results/2026-11-27-h200-loads/NOTES.md).

`freeze_heap` collects once, then moves every object alive to the permanent generation
(gc.freeze): the collector never examines those again, and a full collection walks only
what was made since, mostly the requests in flight. Reference counting still frees a
frozen object; only a frozen cycle stays for good, so call it once, after start-up and
warm-up, when what is alive is meant to stay (vLLM freezes after its warm-up the same
way). At exit the heap is unfrozen again, so that the interpreter's last collection
finalizes what extension modules check for (nanobind reports frozen objects as leaks).
"""
from __future__ import annotations

import atexit
import gc
import time


def freeze_heap() -> int:
    """Collect, then freeze every object alive now; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once per process, however often this is called
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()


class CollectionTimer:
    """Times every collection of the cyclic collector while installed (gc.callbacks; a
    context manager, or install / uninstall): `collected(start, seconds, info)` for each,
    on whichever thread collected. Collections never overlap: one start, then its stop."""

    def __init__(self):
        self._start = 0.0

    def install(self) -> "CollectionTimer":
        gc.callbacks.append(self._on_gc)
        return self

    def uninstall(self) -> None:
        gc.callbacks.remove(self._on_gc)

    __enter__ = install

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _on_gc(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._start = now
        else:
            self.collected(self._start, now - self._start, info)

    def collected(self, start: float, seconds: float, info: dict) -> None:
        """One collection: started at `start` (time.perf_counter()), took `seconds`;
        `info` as gc.callbacks gives it (generation, collected, uncollectable)."""
        raise NotImplementedError
