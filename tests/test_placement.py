"""The control plane's placement over several engine replicas (services/control/manager.py)
with scripted engine links in place of the ZMQ ones: commands reach the placed replicas
that are up, a replica that is down gets the desired state from its replay, and a refused
load is undone where it succeeded (the registry's placement column:
tests/test_services_units.py)."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from loramux.v1 import adapter_admin_pb2 as pb

from loramux_core.v1 import engine_pb2
from loramux_services.control.engine_link import EngineUnavailable
from loramux_services.control.manager import AdapterManager, AdminError
from loramux_services.control.paths import AdapterRoots
from loramux_services.control.registry import AdapterRecord, Registry

_K = engine_pb2.AdapterCommandKind
LOAD, UNLOAD, PIN = (_K.ADAPTER_COMMAND_KIND_LOAD, _K.ADAPTER_COMMAND_KIND_UNLOAD,
                     _K.ADAPTER_COMMAND_KIND_PIN)


class ScriptedLink:
    """An engine replica that acks every command (or refuses LOADs of `refuse`), records
    what it was sent, and holds what it loaded."""

    def __init__(self, up: bool = True, refuse: str = ""):
        self.up, self.refuse = up, refuse
        self.sent: list[tuple[int, str, bool]] = []
        self.held: set[str] = set()
        self.last_event = engine_pb2.EngineEvent()
        self._next_id = 1

    async def command(self, kind, name, path="", pinned=False, version="", connect_wait_s=5.0):
        if not self.up:
            raise EngineUnavailable("the engine is not connected")
        self.sent.append((kind, name, pinned))
        if kind == LOAD and name == self.refuse:
            return engine_pb2.AdapterAck(ok=False, code=engine_pb2.ERROR_CODE_RESOURCE_EXHAUSTED,
                                         message="every slot is pinned")
        if kind == LOAD:
            self.held.add(name)
            self._next_id += 1
        elif kind == UNLOAD:
            self.held.discard(name)
        return engine_pb2.AdapterAck(ok=True, adapter_id=self._next_id)


class Table:
    def __init__(self):
        self.published: list[list[AdapterRecord]] = []
        self.replayed = ["", ""]  # by replica: the engine instance replayed last

    def publish(self, records):
        self.published.append(records)

    def publish_later(self, records):
        self.published.append(records())


@pytest.fixture
def make(tmp_path):
    root = tmp_path / "adapters"
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
    registry = Registry(str(tmp_path / "registry.sqlite"))

    def build(*links) -> AdapterManager:
        return AdapterManager(registry, AdapterRoots([str(root)]),
                              lambda path: (8, ("q_proj",), "v1"), list(links), Table())
    yield build
    registry.close()


def test_load_reaches_every_replica_and_a_subset_when_named(make):
    r0, r1 = ScriptedLink(), ScriptedLink()
    m = make(r0, r1)
    rec = asyncio.run(m.load("a", "a", pinned=True))
    assert rec.state == pb.ADAPTER_STATE_LOADED and rec.replicas == ()
    assert r0.sent == r1.sent == [(LOAD, "a", True)]
    rec = asyncio.run(m.load("b", "b", None, replicas=[1]))
    assert rec.replicas == (1,) and "b" not in r0.held and "b" in r1.held
    assert m.table.published[-1][-1].replicas == (1,)  # gateways learn the placement
    # moving b to replica 0: loaded there, unloaded from replica 1
    rec = asyncio.run(m.load("b", None, None, replicas=[0]))
    assert rec.replicas == (0,) and "b" in r0.held and "b" not in r1.held
    # naming every replica is the default placement
    assert asyncio.run(m.load("b", None, None, replicas=[1, 0])).replicas == ()
    with pytest.raises(AdminError) as info:
        asyncio.run(m.load("a", None, None, replicas=[2]))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_down_replica_is_skipped_then_replayed(make):
    r0, r1 = ScriptedLink(), ScriptedLink(up=False)
    m = make(r0, r1)
    asyncio.run(m.load("a", "a", None))
    asyncio.run(m.set_pinned("a", True))
    assert r0.sent == [(LOAD, "a", False), (PIN, "a", False)] and r1.sent == []
    r1.up = True
    asyncio.run(m.replay(1, "restarted"))
    assert r1.sent == [(LOAD, "a", True)]  # with its pin
    assert m.table.replayed == ["", "restarted"]  # gateways send it adapter requests now
    r0.up = r1.up = False
    with pytest.raises(AdminError) as info:  # nobody to load it on
        asyncio.run(m.load("b", "b", None))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and "replica 0" in str(info.value)
    assert m.registry.get("b") is None  # a refused load forgets the name it registered


def test_a_refused_load_is_undone_where_it_succeeded(make):
    r0, r1 = ScriptedLink(), ScriptedLink(refuse="a")
    m = make(r0, r1)
    with pytest.raises(AdminError) as info:
        asyncio.run(m.load("a", "a", None))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "replica 1" in str(info.value)
    assert r0.sent == [(LOAD, "a", False), (UNLOAD, "a", False)] and not r0.held
    assert m.registry.get("a") is None


def test_unloading_ends_when_no_live_replica_holds_it(make):
    r0, r1 = ScriptedLink(), ScriptedLink()
    m = make(r0, r1)
    asyncio.run(m.load("a", "a", None))
    assert asyncio.run(m.unload("a")).state == pb.ADAPTER_STATE_UNLOADING
    r1.last_event = engine_pb2.EngineEvent(adapters=[engine_pb2.AdapterStatus(name="a")])
    m.on_event(engine_pb2.EngineEvent())  # replica 0 let it go; replica 1 still drains it
    assert m.registry.get("a").state == pb.ADAPTER_STATE_UNLOADING
    r1.up = False  # a dead replica holds nothing
    m.on_event(engine_pb2.EngineEvent())
    assert m.registry.get("a").state == pb.ADAPTER_STATE_REGISTERED
