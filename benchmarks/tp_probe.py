"""Where a decode step's time goes on rank 0 (bench_tp.py decode): instrumentation only.

`StepProbe` wraps the runner's CUDA-graph runner (instance attributes over its `run` and
its staging's `upload`, nothing in the engine changes) to record, per graph step: host
seconds from the step's start to the moment the inputs are uploaded and the replay is
launched (scheduling, the TP plan broadcast, the input fill), and the GPU time of the
replay itself (CUDA events after the upload and after the replay; at TP > 1 this includes
waiting for the other ranks inside the collectives). `profile_steps` prints a
torch.profiler table of a few steps, the GPU kernel time by kind (NCCL, one-shot
all-reduce, RMSNorm, the rest) and the collectives launched per step by kind
(`count_collectives`: all-reduce, all-gather, other NCCL), which is how a run shows that
the LoRA path adds no collective (the same counts with and without adapters)."""
from __future__ import annotations

import statistics
import time

import torch


class StepProbe:
    def __init__(self, runner):
        self._t0 = 0.0
        self._pending = None
        self._marks: list[tuple[float, torch.cuda.Event, torch.cuda.Event]] = []
        graphs = runner.graphs
        if graphs is None:    # eager engine: nothing to wrap
            return
        upload, run = graphs.staging.upload, graphs.run

        def timed_upload():
            upload()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._pending = (time.perf_counter() - self._t0, start)

        def timed_run(*args, **kwargs):
            self._pending = None
            out = run(*args, **kwargs)
            if self._pending is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._marks.append((*self._pending, end))
            return out

        graphs.staging.upload = timed_upload
        graphs.run = timed_run

    def reset(self) -> None:
        self._marks.clear()

    def start(self, t0: float) -> None:
        """Call at the start of each step with its perf_counter time."""
        self._t0 = t0

    def summary(self, step_times: list[float]) -> dict:
        """Medians in ms over the steps since reset (call after a synchronize)."""
        if not self._marks:
            return {"host_to_replay_ms": None, "replay_gpu_ms": None, "rest_ms": None}
        host = statistics.median(m[0] for m in self._marks) * 1e3
        gpu = statistics.median(m[1].elapsed_time(m[2]) for m in self._marks)
        step = statistics.median(step_times) * 1e3
        return {"host_to_replay_ms": host, "replay_gpu_ms": gpu,
                "rest_ms": step - host - gpu, "graph_steps": len(self._marks)}


def _kind(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if "one_shot" in low or "two_shot" in low:
        return "one-shot all-reduce"
    if "rms_norm" in low or "rmsnorm" in low:
        return "rmsnorm"   # what a fused all-reduce + add + RMSNorm would absorb
    return "other"


def collective_of(name: str) -> str | None:
    """The collective a GPU kernel of this name performs: "all_reduce", "all_gather",
    "reduce_scatter", "nccl_other" (another NCCL kernel), or None (not a collective).
    NCCL's kernels are named like ncclDevKernel_AllReduce_Sum_bf16_RING_LL (older NCCL:
    ncclKernel_AllReduce_RING_LL_Sum_bfloat16); the one-shot all-reduce over symmetric
    memory like c10d::symmetric_memory::one_shot_all_reduce_kernel<...>."""
    low = name.lower().replace("_", "")
    if "allreduce" in low:
        return "all_reduce"
    if "allgather" in low:
        return "all_gather"
    if "reducescatter" in low:
        return "reduce_scatter"
    if "nccl" in low:
        return "nccl_other"
    return None


def count_collectives(names, steps: int) -> dict[str, float]:
    """Collective kernels per step, by kind, from the GPU kernel names of `steps` steps."""
    counts: dict[str, int] = {}
    for name in names:
        kind = collective_of(name)
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + 1
    return {k: round(v / steps, 2) for k, v in sorted(counts.items())}


def profile_steps(eng, n: int = 5, label: str = "") -> dict:
    """torch.profiler over `n` engine steps (nothing in flight before them): top 15 ops
    by GPU time, GPU time by kind, collectives per step. Returns the last two."""
    from torch.profiler import ProfilerActivity, profile

    cuda = eng.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    eng.flush()   # async scheduling: the window holds exactly the n steps it launches
    sync()
    t0 = time.perf_counter()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(n):
            eng.step()
        eng.flush()
        sync()
    wall = (time.perf_counter() - t0) / n * 1e3
    averages = prof.key_averages()
    table = None
    for key in ("self_device_time_total", "self_cuda_time_total", "device_time_total",
                "cuda_time_total"):
        try:
            table = averages.table(sort_by=key, row_limit=15, max_name_column_width=70)
            break
        except Exception:  # noqa: BLE001 - the key's name differs between torch versions
            continue
    print(f"profile {label}: {n} steps, {wall:.2f} ms per step under the profiler", flush=True)
    print(table, flush=True)
    by_kind: dict[str, float] = {}
    names = []
    for e in prof.events():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and not e.name.startswith("gloo:"):
            continue   # the CPU: gloo's collectives, nothing else
        names.append(e.name)
        k = _kind(e.name)
        by_kind[k] = by_kind.get(k, 0.0) + e.time_range.elapsed_us()
    per_step = {k: round(v / n / 1e3, 3) for k, v in sorted(by_kind.items())}
    collectives = count_collectives(names, n)
    where = "GPU kernel" if cuda else "gloo collective"
    print(f"profile {where} ms per step by kind {label}: {per_step} ({len(names) / n:.0f} "
          f"{where}s per step)", flush=True)
    print(f"collectives per step {label}: {collectives}", flush=True)
    return {"ms_by_kind": per_step, "collectives_per_step": collectives,
            "events_per_step": len(names) / n, "profiled_ms_per_step": wall}
