"""Prometheus metrics of the gateway, in a registry of their own (no global state)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class GatewayMetrics:
    """Requests, tokens, time to first token and inter-token latency, per adapter
    ("" is the base model)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("loramux_requests", "Generate calls by final status",
                                ["adapter", "status"], registry=r)
        self.prompt_tokens = Counter("loramux_prompt_tokens", "Prompt tokens", ["adapter"],
                                     registry=r)
        self.generated_tokens = Counter("loramux_generated_tokens", "Generated tokens",
                                        ["adapter"], registry=r)
        self.ttft = Histogram("loramux_time_to_first_token_seconds", "Time to first token",
                              ["adapter"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("loramux_inter_token_latency_seconds",
                             "Time between streamed responses, per token", ["adapter"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.inflight = Gauge("loramux_inflight_requests", "Generate calls in flight",
                              registry=r)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics over HTTP; returns the bound port (port 0 picks one)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server.server_port
