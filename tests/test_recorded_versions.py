"""Versions recorded with the earlier digests (sha256 of each 4 MiB chunk, v1): through a
real engine behind real ZMQ sockets (tests/support/served.py), a load naming one is read
and accepted for unchanged files, refused for changed ones, and the same load again (a
pin change, a replay) is applied without reading the files again, as for a current
version; through real engine and control plane processes, a SQLite registry holding one
is replayed while the files are unchanged, and registering the path again records the
current digest. The v1 version is spelled out here, independently of loramux_core."""
from __future__ import annotations

import hashlib
import shutil

import pytest
from loramux import AdminClient

from loramux_engine import Engine, EngineConfig
from loramux_core.v1 import engine_pb2
from loramux_services.control.registry import Registry
from loramux_services.launcher import Cluster
from tests.support import digests
from tests.support.replay import replayed, start_engine_and_control
from tests.support.served import ServedEngine
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

FILES = ("adapter_config.json", "adapter_model.safetensors")
pytestmark = pytest.mark.timeout(300)


def v1_version(adapter) -> str:
    h = hashlib.sha256()
    for name in FILES:
        h.update(f"{name}\0{digests.v1((adapter / name).read_bytes())}\n".encode())
    return h.hexdigest()


def load(served, command_id: str, name: str, path, version: str,
         pinned: bool = False) -> engine_pb2.AdapterAck:
    served.send(adapter_command=engine_pb2.AdapterCommand(
        command_id=command_id, kind=engine_pb2.ADAPTER_COMMAND_KIND_LOAD, name=name,
        path=str(path), version=version, pinned=pinned))
    msgs = served.collect(lambda m: m.WhichOneof("kind") == "adapter_ack"
                          and m.adapter_ack.command_id == command_id)
    return msgs[-1][1].adapter_ack


def test_a_v1_version_loads_once_and_changed_files_are_refused(llama_family, tmp_path):
    adapter = tmp_path / "rs4"
    shutil.copytree(llama_family.adapters["rs4"], adapter)
    old = v1_version(adapter)
    cfg = EngineConfig(model=str(llama_family.model_dir), max_loras=2, max_cpu_loras=2,
                       max_lora_rank=32, block_size=8, num_kv_blocks=64,
                       max_num_batched_tokens=32)
    with Engine(cfg) as eng, ServedEngine(eng) as served:
        first = load(served, "c1", "rs4", adapter, old)
        assert first.ok, first.message
        assert first.version and first.version != old   # the engine holds the v2 digest
        again = load(served, "c2", "rs4", adapter, old, pinned=True)
        assert again.ok and again.adapter_id == first.adapter_id, again.message
        data = bytearray((adapter / FILES[1]).read_bytes())
        data[len(data) // 2] ^= 1
        (adapter / FILES[1]).write_bytes(bytes(data))
        changed = load(served, "c3", "rs4-changed", adapter, old)
        assert not changed.ok and "changed" in changed.message


def test_a_registry_holding_v1_versions_is_replayed_and_registering_records_v2(tmp_path):
    model = make_model(tmp_path / "model", TinySpec())
    adapter = make_adapter(tmp_path / "adapters" / "x", model, AdapterSpec(seed=3))
    run, old = tmp_path / "run", v1_version(adapter)
    with start_engine_and_control(model, tmp_path / "adapters", run) as c:
        with AdminClient(c.control_address) as admin:
            admin.load("x", "x")
    current = _recorded_version(c, "x")
    assert current and current != old
    _record_version(c, "x", old)      # as a registry written before BLAKE3 chunks
    with start_engine_and_control(model, tmp_path / "adapters", run) as c:
        assert replayed(c) == {"x"}
        with AdminClient(c.control_address) as admin:
            admin.register("x", "x")  # the files as they are now: the current digest
    assert _recorded_version(c, "x") == current
    _record_version(c, "x", old)
    weights = adapter / FILES[1]
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    with start_engine_and_control(model, tmp_path / "adapters", run) as c:
        assert replayed(c) == set()  # the engine refused the changed files


def _recorded_version(c: Cluster, name: str) -> str:
    reg = Registry(c.db)
    try:
        return reg.get(name).version
    finally:
        reg.close()


def _record_version(c: Cluster, name: str, version: str) -> None:
    reg = Registry(c.db)
    try:
        reg.put(reg.get(name).evolve(version=version))
    finally:
        reg.close()
