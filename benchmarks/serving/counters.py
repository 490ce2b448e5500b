"""Engine counters around a run, read the same way from the service (an EngineEvent on
the engine's output socket) and from the offline engine (Engine.stats / histograms):
adapter movement (slot loads and evictions, disk reads, host evictions) and the step
loop (steps, time in steps, sequences per forward pass)."""
from __future__ import annotations

from engine.server.events import adapter_totals

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
    out = {k: v for k, v in event.stats.items() if k.startswith("adapter_")}
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
