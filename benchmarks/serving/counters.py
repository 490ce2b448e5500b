"""Engine counters around a run, read the same way from the service (an EngineEvent on
the engine's output socket) and from the offline engine (Engine.stats / histograms):
adapter movement (slot loads and evictions, disk reads, host evictions) and the step
loop (steps, time in steps, sequences per forward pass)."""
from __future__ import annotations

import os

from loramux_engine.server.events import adapter_totals

_HISTOGRAMS = {"step_seconds": ("steps", "step_s"), "batch_size": ("forward_passes", "sequences"),
               "adapter_disk_read_seconds": ("disk_read_count", "disk_read_s"),
               "adapter_slot_load_seconds": ("slot_load_count", "slot_load_s")}


def _from_histograms(items) -> dict[str, float]:
    """items: (name, total count, sum) per histogram."""
    out = {}
    for name, count, total in items:
        if name in _HISTOGRAMS:
            n_key, s_key = _HISTOGRAMS[name]
            out[n_key], out[s_key] = count, total
    return out


def from_event(event) -> dict[str, float]:
    """Counters carried by one engine_pb2.EngineEvent."""
    out = {f.name: float(getattr(event.counters, f.name))
           for f in event.counters.DESCRIPTOR.fields if f.name.startswith("adapter_")}
    out.update(_from_histograms((h.name, sum(h.bucket_counts), h.sum) for h in event.histograms))
    return out


def from_engine(engine) -> dict[str, float]:
    """The same counters from an in-process Engine."""
    out = {k: float(v) for k, v in adapter_totals(engine.stats()).items()}
    out.update(_from_histograms((h.name, h.count, h.sum) for h in engine.histograms()))
    return out


def during(after: dict | None, before: dict | None) -> dict | None:
    """What changed between two snapshots, with the step loop's means: ms per step and
    sequences per forward pass."""
    if after is None or before is None:
        return None
    d = {k: after[k] - before.get(k, 0) for k in after}
    out = {k: (int(v) if float(v).is_integer() else v) for k, v in d.items()}
    if d.get("steps"):
        out["mean_step_ms"] = 1e3 * d["step_s"] / d["steps"]
    if d.get("forward_passes"):
        out["mean_batch"] = d["sequences"] / d["forward_passes"]
    return out


def cpu_seconds(pid: int | None = None) -> float | None:
    """User + system CPU seconds used so far by process `pid` (this one when None): how
    busy the gateway, the engine and the benchmark's own client were during a run."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def busy_share(pids: dict[str, int | None], run) -> tuple[object, dict[str, float | None]]:
    """run(); and, for each named process, its CPU seconds over the run's wall seconds
    (1.0 = one core kept busy the whole time)."""
    import time

    before = {k: cpu_seconds(p) for k, p in pids.items()}
    t = time.perf_counter()
    result = run()
    wall = time.perf_counter() - t
    share = {}
    for k, p in pids.items():
        after = cpu_seconds(p)
        share[k] = None if after is None or before[k] is None else (after - before[k]) / wall
    return result, share


def movement_rates(delta: dict | None, wall_s: float, adapter_bytes: int) -> dict | None:
    """Adapter movement per second of a run: swaps into slots, and the bytes they moved
    host -> device and disk -> host (`adapter_bytes` per adapter: all the benchmark's
    adapters have the same shape)."""
    if delta is None or wall_s <= 0:
        return None
    loads, reads = delta.get("adapter_slot_loads", 0), delta.get("adapter_disk_reads", 0)
    return {"swaps_per_s": loads / wall_s, "slot_bytes_per_s": loads * adapter_bytes / wall_s,
            "disk_bytes_per_s": reads * adapter_bytes / wall_s}
