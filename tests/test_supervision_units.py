"""The supervisor's decisions (backoff, its reset, the crash loop, one line each) on real
short-lived processes under a clock the test moves; the control plane's replica states
from heartbeats and their absence, and their gauge. Fast: no engine."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from loramux_core.v1 import engine_pb2
from loramux_services.control.metrics import ControlMetrics
from loramux_services.control.replica_states import ReplicaStates
from loramux_services.supervisor import CrashLoop, RestartPolicy, Supervisor


class _Processes:
    """What the supervisor needs of a Cluster, over real processes that exit at once with
    `status` (or live until killed)."""

    def __init__(self, tmp: Path, status: int | None):
        self.services, self.engine_names, self.tmp = ("engine-0", "gateway"), ("engine-0",), tmp
        self.status, self.starts = status, []
        self.procs = {}
        for name in self.services:
            self.start(name)

    def start(self, name: str) -> None:
        code = "import time; time.sleep(60)" if self.status is None else f"raise SystemExit({self.status})"
        self.procs[name] = subprocess.Popen([sys.executable, "-c", code])
        self.starts.append(name)

    def is_ready(self, name: str) -> bool:
        return True

    def log_path(self, name: str) -> Path:
        return self.tmp / f"{name}.log"

    def wait_all(self) -> None:
        for p in self.procs.values():
            p.wait(30)

    def close(self) -> None:
        for p in self.procs.values():
            p.kill()
            p.wait()


def _supervised(tmp_path, status, policy):
    clock = SimpleNamespace(now=0.0)
    lines = []
    procs = _Processes(tmp_path, status)
    sup = Supervisor(procs, policy, say=lines.append, clock=lambda: clock.now)
    return procs, sup, clock, lines


def test_backoff_doubles_to_its_cap_and_a_crash_loop_stops(tmp_path):
    policy = RestartPolicy(backoff_s=0.5, max_backoff_s=2.0, crash_loop_deaths=5,
                           crash_loop_window_s=300.0)
    procs, sup, clock, lines = _supervised(tmp_path, 3, policy)
    try:
        waits = []
        with pytest.raises(CrashLoop) as loop:
            for _ in range(20):
                procs.wait_all()
                sup.poll()  # deaths noted, restarts scheduled
                waits += [ln for ln in lines if "restarting it in" in ln and ln not in waits]
                clock.now += 10.0  # every backoff has passed: restart what is due
                sup.poll()
        assert str(loop.value).startswith("engine-0 died 5 times within 300 s (a crash loop)")
        assert str(tmp_path / "engine-0.log") in str(loop.value)
        engine = [ln for ln in waits if ln.startswith("engine-0 ")]
        assert [ln.split(" in ")[1].split(" s ")[0] for ln in engine] == ["0.5", "1", "2", "2"]
        assert engine[0] == (f"engine-0 exited with status 3; restarting it in 0.5 s (attempt 1, "
                             f"log {tmp_path / 'engine-0.log'})")
    finally:
        procs.close()


def test_deaths_apart_are_no_crash_loop_and_healthy_running_resets_the_backoff(tmp_path):
    policy = RestartPolicy(backoff_s=0.5, healthy_s=60.0, crash_loop_deaths=2,
                           crash_loop_window_s=100.0)
    procs, sup, clock, lines = _supervised(tmp_path, 3, policy)
    try:
        for _ in range(4):  # each runs 200 s before it dies: healthy, and no crash loop
            procs.wait_all()
            sup.poll()
            clock.now += 1.0
            sup.poll()
            clock.now += 200.0
        assert sup.restarts == 8
        assert all("restarting it in 0.5 s (attempt 1," in ln for ln in lines
                   if "restarting" in ln)
    finally:
        procs.close()


def test_nothing_restarts_while_processes_live(tmp_path):
    procs, sup, clock, lines = _supervised(tmp_path, None, RestartPolicy())
    try:
        for _ in range(3):
            sup.poll()
            clock.now += 100
        assert lines == [] and procs.starts == ["engine-0", "gateway"]
    finally:
        procs.close()


def _link(up=False, instance="", phase=0, detail="", progress=0.0):
    hb = engine_pb2.Heartbeat(instance_id=instance, phase=phase, phase_detail=detail,
                              phase_progress=progress, phase_eta_s=3.0)
    return SimpleNamespace(up=up, conn=SimpleNamespace(heartbeat=hb))


def test_replica_states_from_heartbeats_and_their_absence():
    P = engine_pb2.EnginePhase
    clock = SimpleNamespace(now=0.0)
    links = [_link(), _link()]
    changes, replayed = [], ["", ""]  # the table's: by replica, the instance replayed last
    states = ReplicaStates(links, lambda i: replayed[i], failed_after_s=30.0,
                           clock=lambda: clock.now,
                           on_change=lambda *c: changes.append(c))
    metrics = ControlMetrics()
    metrics.watch_replicas(states)

    def names():
        from loramux.v1 import adapter_admin_pb2 as pb
        return [pb.ReplicaState.Name(s.state).removeprefix("REPLICA_STATE_").lower()
                for s in states.status()]

    assert names() == ["starting", "starting"]
    links[0] = _link(True, "i1", P.ENGINE_PHASE_WARMING_UP, "capturing decode graphs", 0.4)
    states.up(0, "i1")
    assert names()[0] == "warming_up"
    status = states.status()[0]
    assert (status.detail, status.progress, status.eta_s) == ("capturing decode graphs", 0.4, 3.0)
    links[0] = _link(True, "i1", P.ENGINE_PHASE_SERVING)
    assert names()[0] == "starting"  # serving, its adapters not replayed yet
    replayed[0] = "i1"
    assert names()[0] == "serving"
    text = generate_latest(metrics.registry).decode()
    assert 'loramux:engine_replica_state{replica="0",state="serving"} 1.0' in text
    assert 'loramux:engine_replica_state{replica="0",state="starting"} 0.0' in text
    assert 'loramux:engine_replica_state{replica="1",state="starting"} 1.0' in text
    links[0] = _link(False, "i1", P.ENGINE_PHASE_SERVING)
    states.down(0)
    clock.now = 10.0
    assert names()[0] == "restarting"
    clock.now = 41.0
    assert names()[0] == "failed" and states.status()[0].since_s == 0.0
    links[0] = _link(True, "i2", P.ENGINE_PHASE_SERVING)  # a new engine process
    states.up(0, "i2")
    assert names()[0] == "starting"  # the replay of i1 does not count for i2
    replayed[0] = "i2"
    assert names()[0] == "serving" and states.status()[0].restarts == 1
    assert [c[1:3] for c in changes if c[0] == 0] == [
        ("starting", "warming_up"), ("warming_up", "starting"), ("starting", "serving"),
        ("serving", "restarting"), ("restarting", "failed"), ("failed", "starting"),
        ("starting", "serving")]
    # a restart over between two status() calls still tells both of its transitions
    del changes[:]
    links[0] = _link(False, "i2", P.ENGINE_PHASE_SERVING)
    states.down(0)
    links[0] = _link(True, "i3", P.ENGINE_PHASE_SERVING)
    states.up(0, "i3")
    assert [c[1:3] for c in changes] == [("serving", "restarting"), ("restarting", "starting")]


def test_the_gateway_sends_adapter_requests_to_replayed_engines_only():
    from loramux_services.gateway.adapter_table import AdapterTable

    table = AdapterTable("tcp://127.0.0.1:1")
    try:
        table.update(engine_pb2.AdapterTable())  # a control plane that does not say
        assert table.replayed(0, "i1")
        table.update(engine_pb2.AdapterTable(replayed=["", ""]))  # none replayed yet
        assert not table.replayed(0, "i1") and not table.replayed(1, "j1")
        table.update(engine_pb2.AdapterTable(replayed=["i1", ""]))
        assert table.replayed(0, "i1") and not table.replayed(1, "j1")
        assert not table.replayed(0, "i2")  # replica 0 restarted: not replayed yet
        # a restarted control plane, before its replays: what was replayed stays so
        table.update(engine_pb2.AdapterTable(replayed=["", ""]))
        assert table.replayed(0, "i1")
    finally:
        asyncio.run(table.close())


def test_the_probe_tells_a_warming_engine_from_a_serving_one():
    """`loramux_core.probe`: a heartbeat is alive (start-up, liveness), `--serving` waits for
    one whose phase is SERVING (readiness). Heartbeats from a PUB socket of the test."""
    import threading

    import zmq

    from loramux_core.probe import wait_heartbeat

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    phase = [engine_pb2.ENGINE_PHASE_WARMING_UP]
    done = threading.Event()

    def beat():
        while not done.wait(0.05):
            pub.send(engine_pb2.EngineOutput(heartbeat=engine_pb2.Heartbeat(
                instance_id="e", phase=phase[0])).SerializeToString())
    thread = threading.Thread(target=beat)
    thread.start()
    try:
        address = f"tcp://127.0.0.1:{port}"
        assert wait_heartbeat(address, 5.0).phase == engine_pb2.ENGINE_PHASE_WARMING_UP
        assert wait_heartbeat(address, 1.0, serving=True) is None
        phase[0] = engine_pb2.ENGINE_PHASE_SERVING
        assert wait_heartbeat(address, 5.0, serving=True).phase == engine_pb2.ENGINE_PHASE_SERVING
    finally:
        done.set()
        thread.join()
        pub.close(0)
        ctx.term()
