"""AdapterAdmin semantics over real gRPC, against a real control plane and engine
(separate processes on loopback, SQLite registry): a refused load leaves nothing behind,
LoadAdapter keeps a pin unless told otherwise, one status code per condition across the
RPCs, bounded error messages. The status table is in protos/loramux/v1/adapter_admin.proto."""
from __future__ import annotations

import grpc
import pytest
from loramux import AdminClient, LoramuxError
from loramux.v1 import adapter_admin_pb2 as pb

from loramux_services.launcher import Cluster, ClusterConfig
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

pytestmark = pytest.mark.timeout(300)
MAX_MESSAGE = 1024  # services/common/messages.py


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("admin")
    model = make_model(root / "model", TinySpec())
    for i, name in enumerate(("a1", "a2", "a3", "a4"), start=1):
        make_adapter(root / "adapters" / name, model, AdapterSpec(seed=30 + i))
    make_adapter(root / "adapters" / "wide", model, AdapterSpec(r=16, lora_alpha=16, seed=39))
    cfg = ClusterConfig(model=str(model), adapter_roots=(str(root / "adapters"),),
                        workdir=str(root / "run"),
                        # two slots: one pin at most; the engine takes rank <= 8 while
                        # the control plane validates up to 64, so the engine refuses "wide"
                        engine_args=("--max-loras", "2", "--max-lora-rank", "8"),
                        env={"OMP_NUM_THREADS": "1"})
    c = Cluster(cfg)
    c.start("engine", "control")
    try:
        c.wait_ready("engine", "control")
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def admin(cluster):
    with AdminClient(cluster.control_address) as a:
        yield a


def refused(fn) -> LoramuxError:
    with pytest.raises(LoramuxError) as info:
        fn()
    return info.value


def engine_adapters(cluster) -> dict[str, tuple[int, bool]]:
    """name -> (id, pinned) as the engine reports them in its next event."""
    ev = cluster.wait_output(lambda m: m.WhichOneof("kind") == "event", 30)
    assert ev is not None, "no engine event"
    return {a.name: (a.id, a.pinned) for a in ev.event.adapters if not a.unloading}


def test_refused_load_leaves_nothing_behind(cluster, admin):
    assert admin.load("p1", "a1", pinned=True).pinned
    # a new name the engine refuses (a second pin would take the last dynamic slot)
    err = refused(lambda: admin.load("p2", "a2", pinned=True))
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "dynamic" in err.details
    assert refused(lambda: admin.get("p2")).code == grpc.StatusCode.NOT_FOUND
    assert "p2" not in engine_adapters(cluster)
    loaded = admin.load("p2", "a2")  # the retry without the pin works
    assert loaded.state == pb.ADAPTER_STATE_LOADED and not loaded.pinned
    # a LOADED adapter whose pin is refused stays as it was
    assert refused(lambda: admin.load("p2", pinned=True)).code == \
        grpc.StatusCode.RESOURCE_EXHAUSTED
    again = admin.get("p2")
    assert (again.state, again.pinned, again.id) == (pb.ADAPTER_STATE_LOADED, False, loaded.id)
    # a new name whose weights the engine refuses (rank 16 > its max 8): not registered
    err = refused(lambda: admin.load("w", "wide"))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "rank" in err.details
    assert refused(lambda: admin.get("w")).code == grpc.StatusCode.NOT_FOUND
    # a REGISTERED one stays REGISTERED, and a later load works
    admin.register("w", "wide")
    assert refused(lambda: admin.load("w")).code == grpc.StatusCode.INVALID_ARGUMENT
    assert admin.get("w").state == pb.ADAPTER_STATE_REGISTERED
    admin.unregister("w")
    assert [a.name for a in admin.list()] == ["p1", "p2"]
    assert set(engine_adapters(cluster)) == {"p1", "p2"}


def test_load_keeps_the_pin_unless_told(cluster, admin):
    for a in admin.list():  # room for one pin (the test above leaves p1 pinned)
        if a.pinned:
            admin.unpin(a.name)
    assert admin.load("k", "a3", pinned=True).pinned
    ident = admin.get("k").id
    assert admin.load("k").pinned  # no pinned field: the pin stays
    assert admin.load("k", "a3").pinned
    assert engine_adapters(cluster)["k"] == (ident, True)
    assert not admin.load("k", pinned=False).pinned  # explicit false unpins
    assert not admin.load("k").pinned  # and unset keeps it unpinned
    assert engine_adapters(cluster)["k"] == (ident, False)
    # a pin recorded on a REGISTERED adapter is applied by a load without the field
    admin.register("r", "a4")
    assert admin.pin("r").pinned and admin.get("r").state == pb.ADAPTER_STATE_REGISTERED
    loaded = admin.load("r")
    assert loaded.pinned and engine_adapters(cluster)["r"] == (loaded.id, True)
    admin.unpin("r")


def test_one_status_code_per_condition(admin):
    admin.register("reg", "a4")
    admin.load("p2", "a2")  # loaded (by the first test already, or now)
    unknown = [lambda: admin.load("ghost"), lambda: admin.unload("ghost"),
               lambda: admin.unregister("ghost"), lambda: admin.pin("ghost"),
               lambda: admin.unpin("ghost"), lambda: admin.get("ghost")]
    for call in unknown:
        err = refused(call)
        assert err.code == grpc.StatusCode.NOT_FOUND and "'ghost'" in err.details, err
    wrong_state = [(lambda: admin.unload("reg"), "not loaded"),
                   (lambda: admin.unregister("p2"), "unload it first")]
    for call, words in wrong_state:
        err = refused(call)
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION and words in err.details, err


@pytest.mark.parametrize("call", ["register_name", "register_path", "load_name", "page"])
def test_error_messages_are_bounded(admin, call):
    huge = "x" * 20_000
    before = [(a.name, a.state, a.pinned, a.id) for a in admin.list()]
    fn = {"register_name": lambda: admin.register(huge, "a1"),
          "register_path": lambda: admin.register("fine", huge + "/.."),
          "load_name": lambda: admin.load(huge),
          "page": lambda: admin._call("ListAdapters",
                                      pb.ListAdaptersRequest(page_token="A" * 20_001))}[call]
    err = refused(fn)
    assert err.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)
    assert len(err.details) <= MAX_MESSAGE and "characters cut" in err.details
    after = [(a.name, a.state, a.pinned, a.id) for a in admin.list()]
    assert after == before  # nothing else disturbed
