"""The launcher picks its processes' addresses before it starts them, and another process of
the machine may bind a picked port first (with many test workers side by side, one did).
A process that could not bind a picked address starts again on new ones, with the
processes that connect to it; a port the configuration fixed, or one a serving process
still uses, is never moved. Real processes, real sockets on loopback."""
from __future__ import annotations

import socket
from contextlib import contextmanager

import pytest
from loramux import AdminClient, GenerateClient

from loramux_services.launcher import Cluster, ClusterConfig, wait_serving
from tests.conftest import served_engine_args
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ports")
    model = make_model(root / "model", TinySpec())
    make_adapter(root / "adapters" / "a", model, AdapterSpec(seed=3))
    return root


def _cluster(files, workdir, **kw) -> Cluster:
    return Cluster(ClusterConfig(model=str(files / "model"),
                                 adapter_roots=(str(files / "adapters"),), workdir=str(workdir),
                                 engine_args=served_engine_args(),
                                 env={"OMP_NUM_THREADS": "1"}, **kw))


@contextmanager
def _taken(address: str):
    """Hold `address` ("host:port" or "tcp://host:port") as another process would."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with socket.socket() as s:
        # a port just left may still have connections in TIME_WAIT; listening, it is taken
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, int(port)))
        s.listen()
        yield int(port)


def _generates(c: Cluster) -> None:
    with GenerateClient(c.gateway_address) as gen:
        out = gen.generate([5, 6, 7], "a", temperature=0.0, max_tokens=3, ignore_eos=True)
    assert len(out.token_ids) == 3


def test_a_taken_engine_address_moves_the_engine_and_its_clients(files, tmp_path):
    c = _cluster(files, tmp_path)
    old = c.engine_input
    with _taken(old), c:
        c.start()
        c.wait_ready()
        assert c.engine_input != old
        assert len(c.rebinds) == 1 and c.rebinds[0].startswith(f"engine: {old} -> ")
        assert "Address already in use" in c.log_tail("engine", 100_000)
        wait_serving(c.gateway_address)
        # the control plane and the gateway reach the engine on its new address
        with AdminClient(c.control_address) as admin:
            admin.load("a", "a")
        _generates(c)


def test_a_taken_gateway_address_moves_only_the_gateway(files, tmp_path):
    c = _cluster(files, tmp_path, http_port=0)
    old, engine = c.gateway_address, c.engine_input
    with _taken(old), c:
        c.start()
        c.wait_ready()
        assert c.gateway_address != old and c.engine_input == engine
        assert [r.split(":")[0] for r in c.rebinds] == ["gateway"]
        wait_serving(c.gateway_address)


def test_a_configured_port_that_is_taken_is_an_error(files, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        c = _cluster(files, tmp_path, control_port=port)
        with c:
            c.start("control")
            with pytest.raises(RuntimeError, match="Address already in use"):
                c.wait_ready("control")
        assert c.rebinds == [] and c.control_address == f"127.0.0.1:{port}"


def test_a_restart_keeps_its_address_while_others_use_it(files, tmp_path):
    """An engine restarted while the control plane and the gateway serve keeps its address;
    taken, the restart fails and the others keep serving."""
    c = _cluster(files, tmp_path)
    with c:
        c.start()
        c.wait_ready()
        wait_serving(c.gateway_address)
        c.stop("engine")
        with _taken(c.engine_input):
            c.start("engine")
            with pytest.raises(RuntimeError, match="Address already in use"):
                c.wait_ready("engine")
        assert c.rebinds == [] and c.dead() == ["engine"]  # control, gateway serve on
        c.start("engine")  # the port is free again: back on the same address
        c.wait_ready("engine")
        wait_serving(c.gateway_address)
