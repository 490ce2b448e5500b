"""The engine's and the control plane's state as Prometheus metrics, read at scrape time
from the latest EngineEvent (every 0.5 s) and the latest adapter table the gateway holds,
so they are served on the gateway's endpoint without a copy of either.

Names follow vLLM's where one exists, so routers configured for vLLM need only the prefix
changed. For the Gateway API Inference Extension's endpoint picker:
  queued requests:  loramux:num_requests_waiting
  KV-cache usage:   loramux:kv_cache_usage_perc
  LoRA info:        loramux:lora_requests_info (labels running_lora_adapters,
                    waiting_lora_adapters, max_lora; value: the snapshot's unix time)"""
from __future__ import annotations

import time

from loramux.v1 import adapter_admin_pb2 as admin_pb2
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

_TIERS = {admin_pb2.RESIDENCY_DEVICE: "slot", admin_pb2.RESIDENCY_HOST: "host",
          admin_pb2.RESIDENCY_DISK: "disk"}
_STATES = {admin_pb2.ADAPTER_STATE_REGISTERED: "registered",
           admin_pb2.ADAPTER_STATE_LOADED: "loaded", admin_pb2.ADAPTER_STATE_UNLOADING: "unloading"}
_HISTOGRAMS = {
    "step_seconds": ("loramux:step_seconds", "Wall time of one engine step"),
    "batch_size": ("loramux:batch_size", "Sequences in one forward pass"),
    "adapter_slot_load_seconds": ("loramux:adapter_slot_load_seconds",
                                  "Host to GPU-slot adapter loads (swaps), start to ready"),
    "adapter_disk_read_seconds": ("loramux:adapter_disk_read_seconds",
                                  "Adapter reads from disk into host memory"),
}
MAX_INFO_ADAPTERS = 64  # names in one lora_requests_info label, at most


def _gauge(name: str, doc: str, value: float, labels: dict | None = None) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=list(labels or {}))
    g.add_metric(list((labels or {}).values()), value)
    return g


class EngineCollector:
    """A prometheus_client collector over the gateway's EngineClient and AdapterTable."""

    def __init__(self, engine, table):
        self.engine, self.table = engine, table

    def describe(self):
        return []  # collected on demand only (no fixed set of names at registration)

    def collect(self):
        yield _gauge("loramux:engine_up", "1 while an engine is connected", float(self.engine.up))
        yield from self._registry()
        ev = self.engine.last_event
        if ev is None or not self.engine.up:
            return
        yield _gauge("loramux:num_requests_running", "Requests in the running batch",
                     ev.running_requests)
        yield _gauge("loramux:num_requests_waiting", "Requests waiting to be scheduled",
                     ev.waiting_requests)
        yield from self._kv(ev.stats)
        yield from self._adapters(ev)
        for h in ev.histograms:
            if h.name in _HISTOGRAMS:
                yield _histogram(*_HISTOGRAMS[h.name], h)

    def _kv(self, stats):
        total = stats.get("num_kv_blocks", 0.0)
        used = total - stats.get("free_kv_blocks", total)
        yield _gauge("loramux:kv_cache_blocks_total", "KV cache blocks", total)
        yield _gauge("loramux:kv_cache_blocks_used", "KV cache blocks in use", used)
        yield _gauge("loramux:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)",
                     used / total if total else 0.0)

    def _adapters(self, ev):
        tiers = GaugeMetricFamily("loramux:adapters", "Adapters by residency tier "
                                  "(slot: in a GPU slot, host: host memory, disk)", labels=["tier"])
        counts = {t: 0 for t in _TIERS.values()}
        for a in ev.adapters:
            if a.residency in _TIERS:
                counts[_TIERS[a.residency]] += 1
        for tier, n in counts.items():
            tiers.add_metric([tier], n)
        yield tiers
        max_loras = int(ev.stats.get("max_loras", 0))
        yield _gauge("loramux:max_loras", "GPU adapter slots (max_loras)", max_loras)
        yield _gauge("loramux:adapter_slots_used", "GPU adapter slots in use",
                     ev.stats.get("slots_used", 0.0))
        running = sorted(a.name for a in ev.adapters if a.running_requests and a.name)
        waiting = sorted(a.name for a in ev.adapters if a.waiting_requests and a.name)
        yield _gauge("loramux:lora_requests_info", "Adapters with running and waiting requests "
                     "(label shape of vllm:lora_requests_info); value: unix time of the snapshot",
                     time.time(), {"running_lora_adapters": ",".join(running[:MAX_INFO_ADAPTERS]),
                                   "waiting_lora_adapters": ",".join(waiting[:MAX_INFO_ADAPTERS]),
                                   "max_lora": str(max_loras)})

    def _registry(self):
        """The control plane's registry, by state, from the adapter table it publishes."""
        states = GaugeMetricFamily("loramux:registry_adapters",
                                   "Registered adapters by state (control plane)", labels=["state"])
        counts = {s: 0 for s in _STATES.values()}
        for e in self.table.entries():
            if e.state in _STATES:
                counts[_STATES[e.state]] += 1
        for state, n in counts.items():
            states.add_metric([state], n)
        yield states


def _histogram(name: str, doc: str, snapshot) -> HistogramMetricFamily:
    buckets, cumulative = [], 0
    for bound, count in zip([*snapshot.bounds, float("inf")], snapshot.bucket_counts):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
    h = HistogramMetricFamily(name, doc)
    h.add_metric([], buckets, sum_value=snapshot.sum)
    return h

