"""services/control/manager.py with a real SQLite registry and stand-in engine links: a
LoadAdapter that registers a new name checks the files without reading or hashing them
(the engines do, once) and records the version the engines acked; replicas that acked
different versions (the files changed while they read them) get the load undone and the
call refused; RegisterAdapter and loads of known names still validate and hash here."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from loramux_core.v1 import engine_pb2

from loramux_services.control.manager import AdapterManager, AdminError
from loramux_services.control.paths import AdapterRoots
from loramux_services.control.registry import Registry

_K = engine_pb2.AdapterCommandKind


class Link:
    """An engine replica that acks every command; LOADs with `version`."""

    def __init__(self, version: str):
        self.version = version
        self.up = True
        self.commands: list[tuple[int, str, str]] = []   # (kind, name, version sent)

    async def command(self, kind, name, path="", pinned=False, version="", **_):
        self.commands.append((kind, name, version))
        await asyncio.sleep(0)
        ack = engine_pb2.AdapterAck(ok=True, adapter_id=len(self.commands))
        if kind == _K.ADAPTER_COMMAND_KIND_LOAD:
            ack.version = self.version
        return ack


class Table:
    def publish(self, records) -> None:
        pass

    def publish_later(self, records) -> None:
        pass


@pytest.fixture
def setup(tmp_path):
    (tmp_path / "roots" / "a").mkdir(parents=True)
    calls = {"validator": [], "checker": []}

    def validator(path):
        calls["validator"].append(path)
        return 8, ("q_proj",), "v-here"

    def checker(path):
        calls["checker"].append(path)
        return 8, ("q_proj",)

    def manager(*versions):
        links = [Link(v) for v in versions]
        m = AdapterManager(Registry(str(tmp_path / "reg.sqlite")),
                           AdapterRoots([str(tmp_path / "roots")]), validator, links, Table(),
                           checker)
        return m, links
    return manager, calls


def test_a_new_name_is_read_and_hashed_by_the_engines_only(setup):
    manager, calls = setup
    m, links = manager("v-engine", "v-engine")
    rec = asyncio.run(m.load("x", "a", None))
    assert calls == {"validator": [], "checker": [m.roots.canonical("a")]}
    assert rec.version == "v-engine" and m.registry.get("x").version == "v-engine"
    assert all(link.commands == [(_K.ADAPTER_COMMAND_KIND_LOAD, "x", "")] for link in links)
    # a known name: validated and hashed here, the engines check that version
    asyncio.run(m.register("y", "a"))
    asyncio.run(m.load("y", "a", None))
    assert len(calls["validator"]) == 2 and len(calls["checker"]) == 1
    assert links[0].commands[-1] == (_K.ADAPTER_COMMAND_KIND_LOAD, "y", "v-here")


def test_replicas_that_read_different_files_undo_the_load(setup):
    manager, _ = setup
    m, links = manager("v1", "v2")
    with pytest.raises(AdminError) as info:
        asyncio.run(m.load("x", "a", None))
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "changed" in str(info.value)
    assert m.registry.get("x") is None                      # nothing left behind
    for link in links:
        assert [k for k, _, _ in link.commands] == [_K.ADAPTER_COMMAND_KIND_LOAD,
                                                   _K.ADAPTER_COMMAND_KIND_UNLOAD]
