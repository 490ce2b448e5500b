"""Prometheus metrics of the gateway, in a registry of their own (no global state).

Per adapter only a few counters, and at most `max_adapter_labels` distinct adapter label
values: later adapters count under "other", so a server that has seen thousands of
adapters still exports a bounded number of series. Latency histograms are not split by
adapter. The engine's and the control plane's state are exported by EngineCollector
(services/gateway/engine_metrics.py) in the same registry."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
OTHER_ADAPTERS = "other"


class AdapterLabels:
    """The label value for an adapter name: itself for the first `cap` names seen, then
    OTHER_ADAPTERS. The base model is ""."""

    def __init__(self, cap: int):
        self.cap = cap
        self._seen: set[str] = set()

    def __call__(self, name: str) -> str:
        if not name or name in self._seen:
            return name
        if len(self._seen) >= self.cap:
            return OTHER_ADAPTERS
        self._seen.add(name)
        return name


class GatewayMetrics:
    """Requests, tokens, time to first token, inter-token latency, prefix-cache use."""

    def __init__(self, max_adapter_labels: int = 64):
        self.registry = CollectorRegistry()
        self.adapter_label = AdapterLabels(max_adapter_labels)
        r = self.registry
        self.requests = Counter("loramux_requests", "Generate calls by final status",
                                ["adapter", "status"], registry=r)
        self.prompt_tokens = Counter("loramux_prompt_tokens", "Prompt tokens", ["adapter"],
                                     registry=r)
        self.generated_tokens = Counter("loramux_generated_tokens", "Generated tokens",
                                        ["adapter"], registry=r)
        self.ttft = Histogram("loramux_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("loramux_inter_token_latency_seconds",
                             "Time between streamed responses, per token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.inflight = Gauge("loramux_inflight_requests", "Generate calls in flight",
                              registry=r)
        # hit rate = rate(hits) / rate(queries), as vLLM's prefix_cache_{queries,hits}
        self.prefix_cache_queries = Counter(
            "loramux:prefix_cache_queries", "Prompt tokens of finished requests (looked up "
            "in the prefix cache)", registry=r)
        self.prefix_cache_hits = Counter(
            "loramux:prefix_cache_hits", "Prompt tokens of finished requests served from "
            "the prefix cache", registry=r)
        # affinity hit rate = rate of decisions slot + host over all (router.py)
        self.routed = Counter(
            "loramux:routed_requests", "Requests by the engine replica they were sent to "
            "and why: slot/host/cold (the adapter's residency there, the best among the live "
            "replicas), spill (a worse one, its best replicas being saturated)",
            ["replica", "decision"], registry=r)
        self.failovers = Counter(
            "loramux:requests_resumed", "Requests sent again to a live engine replica after "
            "theirs went down: resent (no token delivered yet) or resumed (after the tokens "
            "already delivered)", ["reason"], registry=r)

    def failover(self, kind: str) -> None:
        self.failovers.labels(kind).inc()

    def route(self, replica: int, decision: str) -> None:
        self.routed.labels(str(replica), decision).inc()

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics over HTTP; returns the bound port (port 0 picks one)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server.server_port
