"""Prometheus metrics of the control plane, in a registry of their own, on its own
/metrics port (--metrics-port): admin calls by method and final status with their
latency, and engine replays. Labels are bounded: eight methods, the gRPC codes."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ControlMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.admin_calls = Counter("loramux_admin_calls", "AdapterAdmin calls by final status",
                                   ["method", "code"], registry=r)
        self.admin_call_seconds = Histogram(
            "loramux_admin_call_seconds", "AdapterAdmin call latency (a load includes the "
            "engine reading and validating the adapter)", ["method"], buckets=_SECONDS,
            registry=r)
        self.replays = Counter("loramux_engine_replays", "Desired state replayed to a "
                               "(re)connected engine", registry=r)

    def observe_call(self, method: str, code: str, seconds: float) -> None:
        self.admin_calls.labels(method, code).inc()
        self.admin_call_seconds.labels(method).observe(seconds)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics over HTTP; returns the bound port (port 0 picks one)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server.server_port
