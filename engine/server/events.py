"""EngineEvent snapshots built from Engine.stats(): adapter residency, in-flight counts,
evictions, and the numeric counters (KV blocks, references, queue lengths)."""
from __future__ import annotations

from loramux.v1 import adapter_admin_pb2

from loramux_core.v1 import engine_pb2

_RESIDENCY = {
    "slot": adapter_admin_pb2.RESIDENCY_DEVICE,
    "device": adapter_admin_pb2.RESIDENCY_DEVICE,
    "gpu": adapter_admin_pb2.RESIDENCY_DEVICE,
    "host": adapter_admin_pb2.RESIDENCY_HOST,
    "cpu": adapter_admin_pb2.RESIDENCY_HOST,
    "disk": adapter_admin_pb2.RESIDENCY_DISK,
}


def max_model_len(engine) -> int:
    """The longest prompt + output the engine accepts."""
    return int(getattr(engine, "max_model_len", None) or engine.config.max_model_len
               or engine.model_config.max_position_embeddings)


def engine_event(stats: dict, loaded: dict, histograms=()) -> engine_pb2.EngineEvent:
    """The event for one stats() snapshot; `loaded` maps name -> LoadedAdapter (path, id)
    for names the control plane loaded, so the event names each adapter even when the
    engine's own stats key them by id. `histograms`: engine/telemetry.py Histograms."""
    ev = engine_pb2.EngineEvent(
        running_requests=int(stats.get("num_running", stats.get("running", 0)) or 0),
        waiting_requests=int(stats.get("num_waiting", stats.get("waiting", 0)) or 0))
    for h in histograms:
        ev.histograms.add(name=h.name, bounds=h.bounds, bucket_counts=h.counts, sum=h.sum)
    ev.counters.CopyFrom(engine_counters(stats))
    for entry in _adapter_entries(stats):
        ev.adapters.append(_adapter_status(entry, loaded))
    return ev


def engine_counters(stats: dict) -> engine_pb2.EngineCounters:
    """The typed counters of one stats() snapshot."""
    def count(key: str) -> int:
        return int(stats.get(key, 0) or 0)
    return engine_pb2.EngineCounters(
        kv_blocks_total=count("num_kv_blocks"), kv_blocks_free=count("free_kv_blocks"),
        max_loras=count("max_loras"), slots_used=count("slots_used"),
        host_copies=count("host_copies"), pending_evictions=count("pending_evictions"),
        base_cached_token_hits=count("base_cached_token_hits"),
        host_reserve_target=count("host_reserve_target"),
        host_reserve_ready=count("host_reserve_ready"),
        host_reserve_taken=count("host_reserve_taken"), **adapter_totals(stats))


_TOTALS = {"loads": "adapter_slot_loads", "evictions": "adapter_slot_evictions",
           "disk_reads": "adapter_disk_reads", "host_evictions": "adapter_host_evictions"}


def adapter_totals(stats: dict) -> dict[str, int]:
    """Engine-wide adapter movement since start, summed over the versions it holds:
    copies into device slots, slot evictions, reads from disk after the first (implicit
    reloads), host-copy evictions."""
    entries = _adapter_entries(stats)
    return {total: sum(int(e.get(key, 0) or 0) for e in entries) for key, total in _TOTALS.items()}


def _adapter_entries(stats: dict) -> list[dict]:
    raw = stats.get("adapters", [])
    if isinstance(raw, dict):
        return [dict(v, name=v.get("name", k)) for k, v in raw.items()]
    return [dict(v) for v in raw]


def _adapter_status(entry: dict, loaded: dict) -> engine_pb2.AdapterStatus:
    name = str(entry.get("name", ""))
    have = loaded.get(name)
    residency = str(entry.get("state", entry.get("residency", ""))).lower()
    slot = entry.get("slot")
    return engine_pb2.AdapterStatus(
        name=name, id=int(entry.get("id", entry.get("adapter_id", have.adapter_id if have else 0))),
        path=str(entry.get("path", have.path if have else "")),
        residency=_RESIDENCY.get(residency, adapter_admin_pb2.RESIDENCY_UNSPECIFIED),
        slot=-1 if slot is None else int(slot),
        pinned=bool(entry.get("pinned", False)),
        unloading=bool(entry.get("unloading", False)),
        in_flight_requests=int(entry.get("in_flight", entry.get("in_flight_requests", 0))),
        loads=int(entry.get("loads", 0)), evictions=int(entry.get("evictions", 0)),
        rank=int(entry.get("rank", 0)), running_requests=int(entry.get("running", 0)),
        waiting_requests=int(entry.get("waiting", 0)))
