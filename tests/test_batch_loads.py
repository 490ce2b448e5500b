"""Loads at scale through the real service (engine, control plane and gateway processes,
real gRPC, ZMQ and SQLite on loopback): fifty adapters from sixteen threads of
AdminClient, and batches through LoadAdapters in which a malformed adapter and a path
outside the roots get their own status while every other item loads. Afterwards the
registry (in memory and in the SQLite file), the engine and the versions agree, and a
sample of the loaded names generates as the adapter it was loaded from. More adapters
than host copies (max_cpu_loras): the later loads are lazy, as a single load would be.
(How fast is measured in benchmarks/bench_admin_loads.py, never asserted here.)"""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from loramux import AdminClient, GenerateClient
from loramux.v1 import adapter_admin_pb2 as pb

from loramux_core.file_digest import FINGERPRINT_PREFIX
from loramux_services.launcher import Cluster, ClusterConfig, wait_serving
from tests.support.tiny import (AdapterSpec, TinySpec, make_adapter, make_model, read_json,
                                write_json)
from tests.test_concurrent_loads import engine_ids

pytestmark = pytest.mark.timeout(600)
DISTINCT, N = 5, 50
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch_loads")
    model = make_model(root / "model", TinySpec())
    adapters = root / "adapters"
    sources = [make_adapter(adapters / f"src{i}", model, AdapterSpec(seed=80 + i))
               for i in range(DISTINCT)]
    for i in range(2 * N):  # same bytes under many directories (hard links)
        d = adapters / f"d{i}"
        d.mkdir()
        for f in sources[i % DISTINCT].iterdir():
            os.link(f, d / f.name)
    bad = shutil.copytree(sources[0], adapters / "bad")
    write_json(bad / "adapter_config.json", {**read_json(bad / "adapter_config.json"),
                                             "target_modules": ["no_such_module"]})
    cfg = ClusterConfig(model=str(model), adapter_roots=(str(adapters),),
                        workdir=str(root / "run"),
                        engine_args=("--max-loras", "4", "--max-cpu-loras", "24"),
                        env={"OMP_NUM_THREADS": "1"})
    c = Cluster(cfg)
    c.start()
    try:
        c.wait_ready()
        wait_serving(c.gateway_address)
        with AdminClient(c.control_address) as admin:
            for i in range(DISTINCT):
                admin.load(f"src{i}", f"src{i}")
        yield c
    finally:
        c.close()


def source_of(name: str) -> str:
    return f"src{int(name.rsplit('d', 1)[1]) % DISTINCT}"


def check_consistent(cluster, names: list[str]) -> None:
    """Every name LOADED with a distinct id, the same in the listing, the SQLite file and
    the engine; each version its source's (or, for a lazy load, the files' fingerprint)."""
    with AdminClient(cluster.control_address) as admin:
        listed = {a.name: a for a in admin.list()}
    assert all(listed[n].state == pb.ADAPTER_STATE_LOADED for n in names)
    ids = {n: listed[n].id for n in names}
    assert len(set(ids.values())) == len(names) and all(i > 0 for i in ids.values())
    with sqlite3.connect(f"file:{cluster.db}?mode=ro", uri=True) as con:
        rows = {n: (s, i, v) for n, s, i, v in
                con.execute("SELECT name, state, adapter_id, version FROM adapters")}
    assert set(rows) == set(listed)
    assert {n: rows[n][:2] for n in listed} == {n: (a.state, a.id) for n, a in listed.items()}
    for n in names:
        version, source = rows[n][2], rows[source_of(n)][2]
        assert version == source or version.startswith(FINGERPRINT_PREFIX), (n, version)
    held = engine_ids(cluster)
    assert {n: held.get(n) for n in names} == ids


def generates_as_source(cluster, names: list[str]) -> None:
    with GenerateClient(cluster.gateway_address) as gen:
        def tokens(adapter):
            return list(gen.generate(PROMPT, adapter, max_tokens=8, temperature=0.0).token_ids)
        base = tokens(None)
        for n in names:
            got = tokens(n)
            assert got == tokens(source_of(n)) and got != base, n


def test_sixteen_threads_load_fifty_adapters(cluster):
    names = [f"d{i}" for i in range(N)]
    with AdminClient(cluster.control_address) as admin, ThreadPoolExecutor(16) as pool:
        loaded = list(pool.map(lambda n: admin.load(n, n), names))
    assert [a.name for a in loaded] == names
    check_consistent(cluster, names)
    generates_as_source(cluster, names[::12])


def test_a_batch_gives_each_item_its_own_status(cluster):
    names = [f"d{i}" for i in range(N, 2 * N)]
    items = [(n, n) for n in names[:25]] + [("bad", "bad"), ("outside", "../../model")]
    items += [{"name": n, "path": n, "pinned": n == names[30]} for n in names[25:]]
    with AdminClient(cluster.control_address) as admin:
        results = admin.load_many(items)
        assert [r.name for r in results] == [it[0] if isinstance(it, tuple) else it["name"]
                                             for it in items]
        by_name = {r.name: r for r in results}
        assert by_name["bad"].code == grpc.StatusCode.INVALID_ARGUMENT
        assert "no_such_module" in by_name["bad"].message
        assert by_name["outside"].code == grpc.StatusCode.PERMISSION_DENIED
        for n in names:
            r = by_name[n]
            assert r.code == grpc.StatusCode.OK and r.adapter.state == pb.ADAPTER_STATE_LOADED
        assert by_name[names[30]].adapter.pinned
        assert {"bad", "outside"}.isdisjoint(a.name for a in admin.list())
        # the same batch again: every load is a no-op with the same ids
        again = admin.load_many([(n, n) for n in names])
        assert [r.adapter.id for r in again] == [by_name[n].adapter.id for n in names]
    check_consistent(cluster, names)
    generates_as_source(cluster, names[::10])


def test_a_malformed_batch_is_refused_whole(cluster):
    with AdminClient(cluster.control_address) as admin:
        with pytest.raises(Exception) as ei:
            admin.load_many([(f"x{i}", "d0") for i in range(1001)])
    assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with AdminClient(cluster.control_address) as admin:
        assert not any(a.name.startswith("x") for a in admin.list())


def test_cli_load_many_reads_a_list_and_says_each_status(cluster):
    lines = "# name path\nc0 d0\n\nc1 d1\nbad bad\n"
    out = subprocess.run([sys.executable, "-m", "loramux.cli", "adapters", "--control",
                          cluster.control_address, "load-many", "-"], input=lines,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    got = {r["name"]: r["code"] for r in json.loads(out.stdout)}
    assert got == {"c0": "OK", "c1": "OK", "bad": "INVALID_ARGUMENT"}


def test_async_client_load_many(cluster):
    import asyncio

    from loramux.aio import AsyncAdminClient

    async def go():
        async with AsyncAdminClient(cluster.control_address) as admin:
            return await admin.load_many([("e0", "d2"), {"name": "e1", "path": "nowhere"}])
    ok, missing = asyncio.run(go())
    assert (ok.name, ok.code, ok.adapter.state) == ("e0", grpc.StatusCode.OK,
                                                   pb.ADAPTER_STATE_LOADED)
    assert missing.name == "e1" and missing.code != grpc.StatusCode.OK and missing.adapter is None
