"""Decode steps with adapter swaps: how benchmarks/bench_adapter_pipeline.py issues one
swap per step (as the engine does for a waiting request's adapter), the ordering the
copies had before issue 20 (for comparison in the same run), and the device timeline of a
few such steps (`profile_steps`: CUDA events around each step's input upload, its graph
replay and each copy, so the table shows where each copy sits against the steps), plus a
torch.profiler trace of them (`trace_steps`). CUDA only, except `SwapIn` and
`slot_loads`."""
from __future__ import annotations

import statistics
import time
import traceback
from pathlib import Path

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


def copies_after_all_compute(engine):
    """The ordering before issue 20's change, for comparison: every copy also waits for
    all the work queued on the compute stream (the step in flight included). Returns the
    function that undoes it."""
    copier = engine.adapters.copier
    queue = copier.queue

    def queue_after_all(slot, adapter_id, copy):
        copier.stream.wait_stream(torch.cuda.current_stream())
        return queue(slot, adapter_id, copy)

    copier.queue = queue_after_all
    return lambda: setattr(copier, "queue", queue)


def time_interleaved(engine, swap: SwapIn, modes: list[tuple[str, int]], chunk: int,
                     rounds: int, setups: dict, log) -> dict[str, float]:
    """Mean seconds per `engine.step()` of each (mode, swaps per step): `rounds` rounds of
    `chunk` steps of every mode, in order, then in reverse order the next round (so what
    one mode leaves in flight weighs on each neighbour alike), steps back to back without
    a sync between chunks: the steady state of the step loop, async scheduling included.
    `setups[mode]()`, where given, applies a mode's setting and returns its undo. Logs
    each mode's mean and its swap count (WARNING where not `swaps per step` each)."""
    spent = dict.fromkeys((m for m, _ in modes), 0.0)
    swaps = dict.fromkeys(spent, 0)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    for r in range(rounds):
        for mode, per_step in (modes if r % 2 == 0 else modes[::-1]):
            undo = setups[mode]() if mode in setups else None
            loads = slot_loads(engine)
            t = time.perf_counter()
            for _ in range(chunk):
                if per_step:
                    swap(per_step)
                engine.step()
            spent[mode] += time.perf_counter() - t
            swaps[mode] += slot_loads(engine) - loads
            if undo is not None:
                undo()
    n = rounds * chunk
    for mode, per_step in modes:
        log(f"steps {mode}: {spent[mode] / n * 1e3:.3f} ms/step over {n} steps "
            f"({rounds} chunks of {chunk}), {swaps[mode]} swaps")
        if swaps[mode] != per_step * n:
            log(f"  WARNING: {swaps[mode]} swaps in {n} steps, expected {per_step} per step")
    return {mode: spent[mode] / n for mode in spent}


def profile_steps(engine, swap: SwapIn, steps: int, log, mode: str,
                  per_step: int = 1) -> list[dict]:
    """The device timeline of `steps` decode steps with `per_step` swaps each, from CUDA
    events recorded around each step's input upload and graph replay (compute stream) and
    around each step's slot loads (the copier's stream: from the first one's start to the
    last one's end). Times in ms from the first step's start. Never raises: a failure is
    logged (the timings stand without it)."""
    try:
        return _profile_steps(engine, swap, steps, log, mode, per_step)
    except Exception:
        log(f"profile {mode} failed:\n{traceback.format_exc()}")
        return []


def _profile_steps(engine, swap, steps, log, mode, per_step) -> list[dict]:
    graphs, pool = engine.runner.graphs, engine.lora_pool
    if graphs is None:
        log("profile: no CUDA graphs (graph_max_batch 0): skipped")
        return []
    marks: list[dict] = []

    def ev():
        e = torch.cuda.Event(enable_timing=True)
        e.record()                        # on the current stream
        return e

    upload, run, load = graphs.staging.upload, graphs.run, pool.load

    def upload_marked():
        marks.append({"start": ev()})     # completes when the previous step's work has
        upload()
        marks[-1]["uploaded"] = ev()

    def run_marked(*a, **k):
        res = run(*a, **k)
        if marks:
            marks[-1]["replayed"] = ev()
        return res

    def load_marked(*a, **k):
        s = ev()
        load(*a, **k)
        if marks:  # queued during the host work of the step in flight
            first = marks[-1].get("copy", (s,))[0]
            marks[-1]["copy"] = (first, ev())

    graphs.staging.upload, graphs.run, pool.load = upload_marked, run_marked, load_marked
    try:
        for _ in range(steps + 1):
            swap(per_step)
            engine.step()
        torch.cuda.synchronize()
    finally:
        del graphs.staging.upload, graphs.run, pool.load
    base = marks[0]["start"]
    rows = []
    for i, m in enumerate(marks[:-1]):
        row = {k: base.elapsed_time(m[k]) for k in ("start", "uploaded", "replayed") if k in m}
        row["end"] = base.elapsed_time(marks[i + 1]["start"])
        if "copy" in m:
            row["copy_start"] = base.elapsed_time(m["copy"][0])
            row["copy_end"] = base.elapsed_time(m["copy"][1])
        rows.append(row)
    log(f"\nprofile {mode}: device timeline of {len(rows)} steps, ms from the first step's "
        "start (a step: input upload, graph replay, sampling; each copy is queued during "
        "the host work of the step on its row)")
    log(f"{'step':>4} {'start':>8} {'upload':>8} {'replayed':>9} {'end':>8}  "
        f"{'copy start':>10} {'copy end':>9}  where")
    for i, r in enumerate(rows):
        where = ""
        if "copy_start" in r:
            later = [j for j, q in enumerate(rows) if q["start"] <= r["copy_start"]]
            k = later[-1] if later else 0
            where = (f"inside step {k}" if r["copy_end"] <= rows[k]["end"]
                     else f"from step {k} into the next")
        log(f"{i:>4} {r['start']:>8.3f} {r.get('uploaded', 0) - r['start']:>8.3f} "
            f"{r.get('replayed', float('nan')):>9.3f} {r['end']:>8.3f}  "
            f"{r.get('copy_start', float('nan')):>10.3f} {r.get('copy_end', float('nan')):>9.3f}"
            f"  {where}")
    uploads = [r["uploaded"] - r["start"] for r in rows if "uploaded" in r]
    periods = [r["end"] - r["start"] for r in rows]
    log(f"median step {statistics.median(periods):.3f} ms, input upload "
        f"{statistics.median(uploads):.3f} ms (max {max(uploads):.3f})")
    return rows


def trace_steps(engine, swap: SwapIn, steps: int, out: Path, log) -> None:
    """A torch.profiler trace (Chrome/Perfetto JSON) of `steps` steps with one swap each:
    the copy's memcpy and kernels on the copier's stream beside the graph replays."""
    from torch.profiler import ProfilerActivity, profile

    path = out / "step_swap_trace.json"
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                swap()
                engine.step()
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(path))
        log(f"trace of {steps} steps with swaps: {path} (open in ui.perfetto.dev)")
    except Exception as exc:  # the profiler is optional: the timeline above stands alone
        log(f"trace skipped: {type(exc).__name__}: {exc}")
