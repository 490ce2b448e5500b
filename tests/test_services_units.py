"""Unit tests of the service parts that need no running cluster: registry persistence,
adapter path policy, names, sampling conversion, the client package without torch, the
generated-code staleness check, the CLI parser, and the demo model against HF + PEFT."""
from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from loramux.cli import build_parser
from loramux.v1 import adapter_admin_pb2 as pb
from loramux.v1 import generate_pb2

from loramux_core.errors import (AdapterNotFoundError, AdapterUnavailableError, CapacityError,
                                 EngineDeadError, PromptTooLongError, error_code)
from loramux_core.sampling import sampling_from_proto
from loramux_services.control.paths import AdapterRoots, PathRefused, check_name
from loramux_services.control.registry import AdapterRecord, Registry

REPO = Path(__file__).resolve().parents[1]


def test_registry_survives_reopen(tmp_path):
    db = str(tmp_path / "r.sqlite")
    reg = Registry(db)
    reg.put(AdapterRecord("b", "/x/b", rank=8, target_modules=("q_proj",)))
    reg.put(AdapterRecord("a", "/x/a", state=pb.ADAPTER_STATE_LOADED, pinned=True, adapter_id=7, loads=1))
    reg.close()
    reg = Registry(db)
    a, b = reg.all()
    assert (a.name, a.state, a.pinned, a.adapter_id, a.loads) == ("a", pb.ADAPTER_STATE_LOADED, True, 7, 1)
    assert (b.name, b.rank, b.target_modules) == ("b", 8, ("q_proj",))
    assert [r.name for r in reg.page("a", 10)] == ["b"]
    assert reg.delete("a") and not reg.delete("a") and reg.get("a") is None


def test_registry_deferred_writes_are_committed_by_flush(tmp_path):
    """A batch's writes are seen at once and reach the file in one flush, as the
    records are then: a later direct write of a name wins, a deleted name stays gone."""
    db = str(tmp_path / "r.sqlite")
    reg = Registry(db)
    reg.put(AdapterRecord("a", "/x/a"), defer=True)
    reg.put(AdapterRecord("b", "/x/b"), defer=True)
    reg.put(AdapterRecord("c", "/x/c"), defer=True)
    assert [r.name for r in reg.all()] == ["a", "b", "c"]

    def on_disk():
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            return dict(con.execute("SELECT name, state FROM adapters"))
    assert on_disk() == {}
    reg.put(reg.get("b").evolve(state=pb.ADAPTER_STATE_LOADED))   # direct: written now
    reg.put(reg.get("a").evolve(state=pb.ADAPTER_STATE_LOADED), defer=True)
    reg.delete("c")
    assert on_disk() == {"b": pb.ADAPTER_STATE_LOADED}
    reg.flush()
    assert on_disk() == {"a": pb.ADAPTER_STATE_LOADED, "b": pb.ADAPTER_STATE_LOADED}
    reg.flush()  # nothing deferred: nothing written
    reg.close()
    assert [(r.name, r.state) for r in Registry(db).all()] == [
        ("a", pb.ADAPTER_STATE_LOADED), ("b", pb.ADAPTER_STATE_LOADED)]


def test_group_commit_answers_only_after_the_commit_and_shares_it(tmp_path):
    """Calls that defer their writes return only when those are on disk; calls finishing
    together share one commit; outside `deferring` writes go to disk at once."""
    from loramux_services.control.group_commit import GroupCommit

    db = str(tmp_path / "r.sqlite")
    reg, flushes = Registry(db), []
    flush = reg.flush
    reg.flush = lambda: (flushes.append(1), flush())
    group = GroupCommit(reg)

    def on_disk():
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            return {n for (n,) in con.execute("SELECT name FROM adapters")}

    async def call(name):
        async with group.deferring():
            async with group.deferring():   # nested: committed once, by the outer one
                reg.put(AdapterRecord(name, "/x"), defer=group.active())
                await asyncio.sleep(0)
            assert name not in on_disk()
        assert name in on_disk()

    async def go():
        await asyncio.gather(*(call(f"n{i}") for i in range(8)))
    asyncio.run(go())
    assert on_disk() == {f"n{i}" for i in range(8)} and len(flushes) < 8
    assert not group.active()
    reg.put(AdapterRecord("direct", "/x"), defer=group.active())
    assert "direct" in on_disk()


def test_adapter_roots(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "ok").mkdir(parents=True)
    (outside / "x").mkdir(parents=True)
    os.symlink(outside / "x", root / "escape")
    os.symlink(root / "ok", root / "alias")
    roots = AdapterRoots([str(root)])
    assert roots.canonical("ok") == str((root / "ok").resolve())
    assert roots.canonical(str(root / "ok")) == str((root / "ok").resolve())
    roots.open_dir("ok").close()
    for bad, why in (("../outside/x", "'..'"), ("ok/../ok", "'..'"), (str(outside / "x"), "outside"),
                     ("", "empty")):
        with pytest.raises(PathRefused, match=why):
            roots.canonical(bad)
    for link in ("escape", "alias"):  # no link is followed, even one staying inside
        with pytest.raises(PathRefused, match="symbolic link"):
            roots.open_dir(link)


def test_adapter_names():
    assert check_name("my-adapter_1.v2") is None
    for bad in ("", "-x", "a b", "a/b", "x" * 129, "é", "a\n"):
        assert "invalid" in check_name(bad)


def test_sampling_conversion_and_error_codes():
    pb_s = generate_pb2.SamplingParams(temperature=0.0, max_tokens=5, stop=["\n"], seed=3)
    sp = sampling_from_proto(pb_s)
    assert (sp.temperature, sp.max_tokens, sp.stop, sp.seed, sp.top_p) == (0.0, 5, ("\n",), 3, 1.0)
    assert sampling_from_proto(generate_pb2.SamplingParams()).temperature == 1.0  # unset: default
    assert error_code(AdapterNotFoundError("x")) == 5
    assert error_code(PromptTooLongError("x")) == 3
    assert error_code(AdapterUnavailableError("x")) == 9
    assert error_code(CapacityError("x")) == 8
    assert error_code(EngineDeadError("x")) == 14  # UNAVAILABLE: a tensor-parallel rank is gone
    assert error_code(RuntimeError("x")) == 13


def test_engine_event_counters_are_typed():
    """Every counter of an Engine.stats() snapshot reaches its EngineCounters field."""
    from loramux_engine.server.events import engine_event

    stats = {"num_kv_blocks": 900, "free_kv_blocks": 850, "running": 3, "waiting": 2,
             "slots_used": 2, "host_copies": 5, "pending_evictions": 1,
             "base_cached_token_hits": 64, "max_loras": 4,
             "adapters": {7: {"name": "a", "state": "slot", "slot": 0, "loads": 3,
                              "evictions": 1, "disk_reads": 2, "host_evictions": 1},
                          9: {"name": "b", "state": "host", "loads": 1, "disk_reads": 1}}}
    ev = engine_event(stats, {})
    c = ev.counters
    assert (c.kv_blocks_total, c.kv_blocks_free, c.max_loras, c.slots_used, c.host_copies,
            c.pending_evictions, c.base_cached_token_hits) == (900, 850, 4, 2, 5, 1, 64)
    assert (c.adapter_slot_loads, c.adapter_slot_evictions, c.adapter_disk_reads,
            c.adapter_host_evictions) == (4, 1, 3, 1)
    assert (ev.running_requests, ev.waiting_requests) == (3, 2)
    assert [a.name for a in ev.adapters] == ["a", "b"]


def test_gateway_rejections_one_code_per_condition_and_bounded():
    import grpc

    from loramux_services.gateway.errors import Rejected
    # the gateway sends only names its table has LOADED: an engine lacking one is a known
    # name in the wrong state, as a REGISTERED name is (adapter_table.py)
    assert Rejected.from_wire(5, "adapter 'a' is not loaded").code == \
        grpc.StatusCode.FAILED_PRECONDITION
    assert Rejected.from_wire(3, "bad").code == grpc.StatusCode.INVALID_ARGUMENT
    assert Rejected.from_wire(77, "odd").code == grpc.StatusCode.INTERNAL
    full = f"adapter {'x' * 20_000!r} is not registered"
    msg = str(Rejected(grpc.StatusCode.NOT_FOUND, full))
    kept, cut = msg.rsplit("... (", 1)
    assert len(msg) <= 1024 and full.startswith(kept)
    assert cut == f"{len(full) - len(kept)} characters cut)"


def test_client_package_imports_without_torch():
    code = ("import sys, builtins\n"
            "real = builtins.__import__\n"
            "def guard(name, *a, **k):\n"
            "    if name.split('.')[0] in ('torch', 'engine', 'services'):\n"
            "        raise ImportError('blocked ' + name)\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = guard\n"
            "import loramux, loramux.aio, loramux.cli\n"
            "from loramux.v1 import generate_pb2_grpc, adapter_admin_pb2_grpc\n"
            "loramux.cli.build_parser().parse_args(['adapters', 'list'])\n"
            "import importlib.util\n"
            "assert importlib.util.find_spec('loramux.v1.engine_pb2') is None, 'internal proto'\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd="/")
    assert out.stdout.strip() == "ok", out.stderr


def test_generated_code_is_fresh_and_check_detects_staleness(tmp_path):
    pytest.importorskip("grpc_tools", reason="the proto compiler (grpcio-tools, a test extra)")
    ok = subprocess.run(["bash", "scripts/gen_protos.sh", "--check"], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    # A copy of the repository passes; with a changed public or internal proto, it fails.
    env = {**os.environ, "PYTHON": sys.executable}
    for proto, anchor, package in [
            ("loramux/v1/generate.proto", "string request_id = 5;", "clients/python/loramux/v1"),
            ("loramux_core/v1/engine.proto", "string request_id = 1;", "./loramux_core/v1")]:
        copy = tmp_path / proto.split("/")[0]
        for part in ("protos", "scripts", "clients/python/loramux/v1", "loramux_core/v1"):
            shutil.copytree(REPO / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
        check = ["bash", "scripts/gen_protos.sh", "--check"]
        fresh = subprocess.run(check, cwd=copy, capture_output=True, text=True, timeout=120, env=env)
        assert fresh.returncode == 0, fresh.stderr
        path = copy / "protos" / proto
        assert anchor in path.read_text()
        path.write_text(path.read_text().replace(anchor, anchor + "\n  int32 extra = 99;", 1))
        stale = subprocess.run(check, cwd=copy, capture_output=True, text=True, timeout=120, env=env)
        assert stale.returncode == 1 and "stale" in stale.stderr, stale.stderr
        assert stale.stderr.count(" is stale") == 1 and f"in {package} is stale" in stale.stderr


def test_cli_parser():
    p = build_parser()
    a = p.parse_args(["generate", "--adapter", "x", "--max-tokens", "3", "hello there"])
    assert (a.command, a.adapter, a.max_tokens, a.prompt) == ("generate", "x", 3, "hello there")
    a = p.parse_args(["adapters", "--control", "h:1", "load", "n", "--path", "p", "--pinned"])
    assert (a.action, a.name, a.path, a.pinned, a.control) == ("load", "n", "p", True, "h:1")
    load = ["adapters", "--control", "h:1", "load", "n"]
    assert p.parse_args(load).pinned is None  # unset: the adapter keeps its pin
    assert p.parse_args([*load, "--no-pinned"]).pinned is False
    for action in ("register", "load", "unload", "unregister", "pin", "unpin", "get", "list"):
        extra = {"register": ["n", "p"], "list": []}.get(action, ["n"])
        assert p.parse_args(["adapters", action, *extra]).action == action
    with pytest.raises(SystemExit):
        p.parse_args(["adapters", "frobnicate"])


def test_demo_model_matches_transformers_and_peft(tmp_path):
    """The demo files we write by hand load in HF + PEFT and give the engine's tokens."""
    import torch
    from peft import PeftModel

    from loramux_engine import Engine, EngineConfig, SamplingParams
    from loramux_services.demo_model import DEMO_ADAPTERS, DemoSpec, ensure_demo
    from tests.support.tiny import load_hf_model

    demo = ensure_demo(tmp_path, DemoSpec(hidden_size=64, intermediate_size=128))
    assert ensure_demo(tmp_path) == demo  # made once
    eng = Engine(EngineConfig(model=str(demo)))
    adapter = str(demo / "adapters" / DEMO_ADAPTERS[0])
    eng.add_adapter("a", adapter)
    ids = eng.tokenizer.encode("the quick brown fox")
    ours = eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=8), adapters=["a"])[0]
    model = PeftModel.from_pretrained(load_hf_model(demo), adapter).eval()
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):]
    assert ours.token_ids == ref.tolist()[:len(ours.token_ids)]
    assert len(ours.token_ids) == 8 or ours.finish_reason == "eos"


def test_registry_written_before_versions_and_placements_opens_and_records_them(tmp_path):
    import sqlite3
    db = str(tmp_path / "old.sqlite")
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE adapters (name TEXT PRIMARY KEY, path TEXT NOT NULL, state INTEGER "
                "NOT NULL, pinned INTEGER NOT NULL DEFAULT 0, adapter_id INTEGER NOT NULL DEFAULT 0, "
                "rank INTEGER NOT NULL DEFAULT 0, target_modules TEXT NOT NULL DEFAULT '[]', "
                "loads INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL)")
    con.execute("INSERT INTO adapters (name, path, state, created_at) VALUES ('a', '/x/a', 1, 1.0)")
    con.commit()
    con.close()
    reg = Registry(db)
    assert reg.get("a").version == ""          # unknown: the engine does not check it
    assert reg.get("a").replicas == ()         # placed on every engine replica
    reg.put(reg.get("a").evolve(version="ab" * 32, replicas=(1,)))
    reg.close()
    assert (Registry(db).get("a").version, Registry(db).get("a").replicas) == ("ab" * 32, (1,))
