"""Decode steps with adapter swaps: how benchmarks/bench_adapter_pipeline.py issues them
(`SwapIn`, as the engine does for a waiting request's adapter) and times steps with and
without them, the modes interleaved (`time_interleaved`)."""
from __future__ import annotations

import time

import torch


def slot_loads(engine) -> int:
    return sum(a["loads"] for a in engine.stats()["adapters"].values())


class SwapIn:
    """What the engine does for waiting requests' adapters (its `_schedule`): `swap(n)`
    prefetches the next `n` spares, round robin, into slots, evicting only adapters without
    running requests; the copies are queued on the copier's side stream while the step in
    flight runs. With more spares than the slots they can take plus `n`, every call swaps
    in `n` adapters that are not in a slot (the least recently used ones)."""

    def __init__(self, engine, spares: list[int]):
        self.engine, self.spares, self.next = engine, spares, 0

    def __call__(self, n: int = 1) -> None:
        wanted = [self.spares[(self.next + j) % len(self.spares)] for j in range(n)]
        self.next += n
        self.engine.adapters.prefetch(wanted, busy=self.engine.scheduler.running_adapters())


def time_interleaved(engine, swap: SwapIn, modes: list[tuple[str, int]], chunk: int,
                     rounds: int, log) -> dict[str, float]:
    """Mean seconds per `engine.step()` of each (mode, swaps per step): `rounds` rounds of
    `chunk` steps of every mode, in order, then in reverse order the next round (so what
    one mode leaves in flight weighs on each neighbour alike), steps back to back without
    a sync between chunks: the steady state of the step loop, async scheduling included.
    Logs each mode's mean and its swap count (WARNING where not `swaps per step` each)."""
    spent = dict.fromkeys((m for m, _ in modes), 0.0)
    swaps = dict.fromkeys(spent, 0)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    for r in range(rounds):
        for mode, per_step in (modes if r % 2 == 0 else modes[::-1]):
            loads = slot_loads(engine)
            t = time.perf_counter()
            for _ in range(chunk):
                if per_step:
                    swap(per_step)
                engine.step()
            spent[mode] += time.perf_counter() - t
            swaps[mode] += slot_loads(engine) - loads
    n = rounds * chunk
    for mode, per_step in modes:
        log(f"steps {mode}: {spent[mode] / n * 1e3:.3f} ms/step over {n} steps "
            f"({rounds} chunks of {chunk}), {swaps[mode]} swaps")
        if swaps[mode] != per_step * n:
            log(f"  WARNING: {swaps[mode]} swaps in {n} steps, expected {per_step} per step")
    return {mode: spent[mode] / n for mode in spent}
