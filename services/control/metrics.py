"""Prometheus metrics of the control plane, in a registry of their own, on its own
/metrics port (--metrics-port): admin calls by method and final status with their
latency, engine replays, and each engine replica's state. Labels are bounded: the
methods, the gRPC codes, the replicas and their five states."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

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

    def watch_replicas(self, states) -> None:
        """Export `loramux:engine_replica_state{replica,state}` (1 for the replica's state
        now, 0 for the others) from a loramux_services.control.replica_states.ReplicaStates."""
        self.registry.register(_ReplicaStateCollector(states))

    def observe_call(self, method: str, code: str, seconds: float) -> None:
        self.admin_calls.labels(method, code).inc()
        self.admin_call_seconds.labels(method).observe(seconds)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics over HTTP; returns the bound port (port 0 picks one)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server.server_port


class _ReplicaStateCollector:
    """Reads the replicas' states at each scrape, so the gauge is never stale."""

    def __init__(self, states):
        self._states = states

    def collect(self):
        from loramux_services.control.replica_states import STATE_NAMES

        family = GaugeMetricFamily("loramux:engine_replica_state",
                                   "1 for the state each engine replica is in now (starting, "
                                   "warming_up, serving, restarting, failed)",
                                   labels=["replica", "state"])
        for status in self._states.status():
            for state, name in STATE_NAMES.items():
                family.add_metric([str(status.replica), name], float(status.state == state))
        yield family
