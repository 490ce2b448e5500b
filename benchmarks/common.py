"""Timing helpers for GPU benchmarks: measured copy bandwidth (the roofline we divide by),
CUDA-graph timing over rotating buffer sets (so a 50 MB L2 cannot flatter small kernels),
and launch counting. Everything here needs CUDA except the pure arithmetic."""
from __future__ import annotations

import csv
import statistics
from pathlib import Path
from typing import Callable, Sequence

import torch

LAUNCH_FLOOR_S = 2.5e-6        # per kernel launch inside a CUDA graph (PERF.md)


def copy_bandwidth(gib: float = 4.0, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    n = int(gib * (1 << 30)) // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / statistics.median(times)


def time_graph(calls: Sequence[Callable[[], object]], calls_per_graph: int = 32,
               replays: int = 7) -> float:
    """Median seconds per call of `calls` (one closure per rotating buffer set), captured
    back to back in one CUDA graph, round robin. Each closure must already be warm."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):          # warm-up outside capture (allocator, autotune)
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls_per_graph):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls_per_graph)
    del graph
    return statistics.median(times)


def time_do_bench(fn: Callable[[], object]) -> float:
    """Median seconds per call by triton.testing.do_bench (flushes L2 between calls)."""
    import triton.testing
    return triton.testing.do_bench(fn, return_mode="median") / 1e3


def device_events(prof) -> list:
    """The profiled work that ran on the GPU (kernels, memsets, copies: one per launch or
    graph node), not the runtime and driver calls that issued it."""
    kinds = ("cuda_runtime", "cuda_driver")
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not any(k in e.name.lower() for k in kinds)]


def count_launches(fn: Callable[[], object]) -> int:
    """GPU kernels (and memsets) launched by one call of fn (fn must be warm)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return len(device_events(prof))


def rotating_sets(bytes_per_set: int, l2_bytes: int = 50 << 20, most: int = 8) -> int:
    """How many buffer sets to rotate so that one round exceeds 4x the L2."""
    if bytes_per_set <= 0:
        return most
    return max(2, min(most, -(-4 * l2_bytes // bytes_per_set)))


def floor_seconds(nbytes: int, bandwidth: float, launches: int) -> float:
    """Memory floor plus the graph launch floor."""
    return nbytes / bandwidth + launches * LAUNCH_FLOOR_S


def report(out: str | None, name: str, result: dict, row: dict[str, str]) -> None:
    """Write `result` as JSON to OUT/name when `out` is given, and print `row` (column
    header -> cell) as a one-row markdown table."""
    import json
    from pathlib import Path

    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / name).write_text(json.dumps(result, indent=2))
    print("\n| " + " | ".join(row) + " |")
    print("|" + "---|" * len(row))
    print("| " + " | ".join(row.values()) + " |")


def write_csv(path: Path, rows: list[dict]) -> None:
    """`rows` (dicts of the same keys; the first's order gives the columns) as a CSV file."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


class TeeLog:
    """log(msg): printed (flushed) and written to `path` (its folder made), so that the
    whole output of a run is also among the files under --out."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "w")

    def __call__(self, msg: str) -> None:
        print(msg, flush=True)
        self._file.write(msg + "\n")

    def close(self) -> None:
        self._file.close()
