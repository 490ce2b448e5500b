"""Many AdapterAdmin calls in flight at once over real gRPC (a real control plane and
engine on loopback): loads of different names run concurrently through the control plane
and the engine's readers, and when they are done the registry and the engine agree on
every name's id; loads, unloads and re-registrations of one name in flight together keep
it consistent. (How much faster a burst is than one load at a time is measured in
benchmarks/bench_adapter_pipeline.py, never asserted here.)"""
from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import grpc
import pytest
from loramux import LoramuxError
from loramux.aio import AsyncAdminClient
from loramux.v1 import adapter_admin_pb2 as pb

from loramux_services.launcher import Cluster, ClusterConfig
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

pytestmark = pytest.mark.timeout(300)
N = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("concurrent")
    model = make_model(root / "model", TinySpec())
    for i in range(N):
        make_adapter(root / "adapters" / f"f{i}", model, AdapterSpec(seed=60 + i))
    cfg = ClusterConfig(model=str(model), adapter_roots=(str(root / "adapters"),),
                        workdir=str(root / "run"),
                        engine_args=("--max-loras", "4", "--max-cpu-loras", str(2 * N)),
                        env={"OMP_NUM_THREADS": "1"})
    c = Cluster(cfg)
    c.start("engine", "control")
    try:
        c.wait_ready("engine", "control")
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def loaded(cluster):
    """n0..n{N-1} loaded from f0..f{N-1}: by the first test already (then these loads are
    no-ops), or here when a later test runs alone."""
    async def go():
        async with AsyncAdminClient(cluster.control_address) as admin:
            for i in range(N):
                await admin.load(f"n{i}", f"f{i}")
    run(go())


def engine_ids(cluster, settle_s: float = 10.0) -> dict[str, int]:
    """name -> id of the adapters the engine holds (not unloading), from an event sent
    after every command was acknowledged."""
    deadline = time.monotonic() + settle_s
    while True:
        ev = cluster.wait_output(lambda m: m.WhichOneof("kind") == "event", 30)
        assert ev is not None, "no engine event"
        held = {a.name: a.id for a in ev.event.adapters if not a.unloading}
        if time.monotonic() > deadline or all(not a.unloading for a in ev.event.adapters):
            return held


def run(coro):
    return asyncio.run(coro)


def test_concurrent_loads_all_succeed_and_registry_and_engine_agree(cluster):
    async def go():
        async with AsyncAdminClient(cluster.control_address) as admin:
            loaded = await asyncio.gather(*(admin.load(f"n{i}", f"f{i}") for i in range(N)))
            return loaded, await admin.list()
    loaded, listed = run(go())
    assert all(a.state == pb.ADAPTER_STATE_LOADED for a in loaded)
    assert len({a.id for a in loaded}) == N and all(a.id > 0 for a in loaded)
    registry = {a.name: a.id for a in listed}
    assert registry == {a.name: a.id for a in loaded}
    assert engine_ids(cluster) == registry


def test_versions_come_from_the_engine_read_and_survive_a_replay(cluster, loaded):
    """A LoadAdapter of a new name does not read and hash the files in the control plane
    (the engine does, once): the version it records is the digest of the files, and an
    engine that restarts gets the loads replayed with it and accepts them."""
    from loramux_engine.lora import validate_lora
    from loramux_core.model.hf_config import ModelConfig

    cfg = ModelConfig.from_dir(cluster.cfg.model)
    root = Path(cluster.cfg.adapter_roots[0])
    with sqlite3.connect(f"file:{cluster.db}?mode=ro", uri=True) as con:
        recorded = dict(con.execute("SELECT name, version FROM adapters"))
    assert set(recorded) == {f"n{i}" for i in range(N)}
    for i in range(N):
        assert recorded[f"n{i}"] == validate_lora(root / f"f{i}", cfg, 8).version != ""
    cluster.stop("engine")
    cluster.start("engine")
    cluster.wait_ready("engine")
    deadline = time.monotonic() + 60
    while len(held := engine_ids(cluster)) < N:
        assert time.monotonic() < deadline, f"replay brought back {sorted(held)}"

    async def listed():
        async with AsyncAdminClient(cluster.control_address) as admin:
            return {a.name: a.id for a in await admin.list()}
    assert run(listed()) == held


def test_one_name_in_flight_many_times_stays_consistent(cluster, loaded):
    """Loads of one name from two paths, pins, unloads and loads again, all at once with
    loads of other names: each call gets a precise answer, and afterwards the registry
    and the engine agree."""
    async def go():
        async with AsyncAdminClient(cluster.control_address) as admin:
            calls = [admin.load("n0", "f0", pinned=True), admin.load("n0", "f1"),
                     admin.unload("n1"), admin.load("n1"), admin.pin("n2"),
                     admin.load("m0", "f3"), admin.load("m1", "f4"), admin.unload("n3")]
            results = await asyncio.gather(*calls, return_exceptions=True)
            return results, await admin.list()
    results, listed = run(go())
    for r in results:
        if isinstance(r, LoramuxError):   # refused for a stated reason, nothing else
            assert r.code in (grpc.StatusCode.ALREADY_EXISTS,
                              grpc.StatusCode.FAILED_PRECONDITION), r
        else:
            assert not isinstance(r, BaseException), r
    assert isinstance(results[1], LoramuxError) and \
        results[1].code == grpc.StatusCode.ALREADY_EXISTS          # n0 comes from f0
    assert not isinstance(results[0], BaseException) and results[0].pinned
    loaded = {a.name: a.id for a in listed if a.state == pb.ADAPTER_STATE_LOADED}
    assert {"n0", "n2", "m0", "m1"} <= set(loaded)
    held = engine_ids(cluster)
    assert {n: held.get(n) for n in loaded} == loaded
    unloading = {a.name for a in listed if a.state == pb.ADAPTER_STATE_UNLOADING}
    assert not set(held) - set(loaded) - unloading


def test_concurrent_unloads_then_unregisters(cluster):
    async def go():
        async with AsyncAdminClient(cluster.control_address) as admin:
            names = [a.name for a in await admin.list()]
            await asyncio.gather(*(admin.unpin(n) for n in names))
            loaded = [a.name for a in await admin.list() if a.state == pb.ADAPTER_STATE_LOADED]
            await asyncio.gather(*(admin.unload(n) for n in loaded))
            deadline = time.monotonic() + 30
            while any(a.state != pb.ADAPTER_STATE_REGISTERED for a in await admin.list()):
                assert time.monotonic() < deadline, "unloads did not drain"
                await asyncio.sleep(0.05)
            await asyncio.gather(*(admin.unregister(n) for n in names))
            return await admin.list()
    assert run(go()) == []
    assert engine_ids(cluster) == {}
