"""The engine's and the control plane's state as Prometheus metrics, read at scrape time
from the latest EngineEvent (every 0.5 s) and the latest adapter table the gateway holds,
so they are served on the gateway's endpoint without a copy of either. Every engine
series carries a `replica` label (the replica's index; "0" with one engine).

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
    "gc_pause_seconds": ("loramux:engine_gc_pause_seconds",
                         "Garbage collections in the engine process (each holds its steps)"),
}
MAX_INFO_ADAPTERS = 64  # names in one lora_requests_info label, at most


class _Families:
    """Metric families by name, filled replica by replica, yielded once each."""

    def __init__(self):
        self._families: dict[str, GaugeMetricFamily | HistogramMetricFamily] = {}

    def gauge(self, name: str, doc: str, labels: dict, value: float) -> None:
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = GaugeMetricFamily(name, doc, labels=list(labels))
        family.add_metric(list(labels.values()), value)

    def histogram(self, name: str, doc: str, replica: str, snapshot) -> None:
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = HistogramMetricFamily(name, doc, labels=["replica"])
        family.add_metric([replica], _buckets(snapshot), sum_value=snapshot.sum)

    def __iter__(self):
        return iter(self._families.values())


class EngineCollector:
    """A prometheus_client collector over the gateway's EngineClient (every replica, with
    a `replica` label: its index) and AdapterTable."""

    def __init__(self, engine, table):
        self.engine, self.table = engine, table

    def describe(self):
        return []  # collected on demand only (no fixed set of names at registration)

    def collect(self):
        out = _Families()
        yield from self._registry()
        for replica in self.engine.replicas:
            self._replica(out, replica)
        yield from out

    def _replica(self, out: _Families, replica) -> None:
        label = {"replica": str(replica.index)}
        out.gauge("loramux:engine_up", "1 while the engine replica is connected", label,
                  float(replica.up))
        out.gauge("loramux:gateway_requests_inflight", "This gateway's requests in flight "
                  "on the engine replica", label, len(replica.streams))
        ev = replica.last_event
        if ev is None or not replica.up:
            return
        out.gauge("loramux:num_requests_running", "Requests in the running batch", label,
                  ev.running_requests)
        out.gauge("loramux:num_requests_waiting", "Requests waiting to be scheduled", label,
                  ev.waiting_requests)
        self._kv(out, label, ev.counters)
        self._adapters(out, label, ev)
        self._host_reserve(out, label, ev.counters)
        for h in ev.histograms:
            if h.name in _HISTOGRAMS:
                out.histogram(*_HISTOGRAMS[h.name], label["replica"], h)

    def _kv(self, out: _Families, label: dict, counters) -> None:
        total = counters.kv_blocks_total
        used = total - counters.kv_blocks_free
        out.gauge("loramux:kv_cache_blocks_total", "KV cache blocks", label, total)
        out.gauge("loramux:kv_cache_blocks_used", "KV cache blocks in use", label, used)
        out.gauge("loramux:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)",
                  label, used / total if total else 0.0)

    def _host_reserve(self, out: _Families, label: dict, counters) -> None:
        out.gauge("loramux:host_reserve_target", "Host buffers the engine makes ready at "
                  "start for adapters' host copies (0: no reserve)", label,
                  counters.host_reserve_target)
        out.gauge("loramux:host_reserve_ready", "Of them, those made ready so far (equal "
                  "to the target once the reserve is complete)", label,
                  counters.host_reserve_ready)
        out.gauge("loramux:host_reserve_taken", "Reserved host buffers loads have taken",
                  label, counters.host_reserve_taken)

    def _adapters(self, out: _Families, label: dict, ev) -> None:
        counts = {t: 0 for t in _TIERS.values()}
        for a in ev.adapters:
            if a.residency in _TIERS:
                counts[_TIERS[a.residency]] += 1
        for tier, n in counts.items():
            out.gauge("loramux:adapters", "Adapters by residency tier (slot: in a GPU slot, "
                      "host: host memory, disk)", {**label, "tier": tier}, n)
        max_loras = ev.counters.max_loras
        out.gauge("loramux:max_loras", "GPU adapter slots (max_loras)", label, max_loras)
        out.gauge("loramux:adapter_slots_used", "GPU adapter slots in use", label,
                  ev.counters.slots_used)
        running = sorted(a.name for a in ev.adapters if a.running_requests and a.name)
        waiting = sorted(a.name for a in ev.adapters if a.waiting_requests and a.name)
        out.gauge("loramux:lora_requests_info", "Adapters with running and waiting requests "
                  "(label shape of vllm:lora_requests_info); value: unix time of the snapshot",
                  {**label, "running_lora_adapters": ",".join(running[:MAX_INFO_ADAPTERS]),
                   "waiting_lora_adapters": ",".join(waiting[:MAX_INFO_ADAPTERS]),
                   "max_lora": str(max_loras)}, time.time())

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


def _buckets(snapshot) -> list[tuple[str, int]]:
    buckets, cumulative = [], 0
    for bound, count in zip([*snapshot.bounds, float("inf")], snapshot.bucket_counts):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
    return buckets

