"""The control plane's engine link (services/control/engine_link.py) over a real ZMQ
PUB/SUB pair: an engine that heartbeats while it loads and warms up is heard but not up
(services/common/engine_connection.py: up only while its heartbeat says SERVING), gets no
replay and no command (a command then waits for it to serve, up to its connect wait); its
first SERVING heartbeat makes it up and starts the replay, once."""
from __future__ import annotations

import asyncio

import pytest
import zmq

from loramux_core.v1 import engine_pb2
from loramux_services.control.engine_link import EngineLink, EngineUnavailable


def _heartbeat(seq: int, phase: int) -> bytes:
    return engine_pb2.EngineOutput(instance_id="e", heartbeat=engine_pb2.Heartbeat(
        instance_id="e", seq=seq, phase=phase)).SerializeToString()


async def _beat(pub, phase: int, seconds: float) -> None:
    for seq in range(int(seconds / 0.01)):
        pub.send(_heartbeat(seq, phase))
        await asyncio.sleep(0.01)


def test_a_starting_engine_is_replayed_to_once_it_serves():
    async def run():
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        connects: list[str] = []

        async def on_connect(instance_id: str) -> None:
            connects.append(instance_id)
        link = EngineLink(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port}",
                          on_connect=on_connect, on_event=lambda e: None,
                          heartbeat_timeout_s=5.0)
        await link.start()
        try:
            while link.conn.instance_id != "e":   # the slow joiner
                pub.send(_heartbeat(0, engine_pb2.ENGINE_PHASE_LOADING))
                await asyncio.sleep(0.01)
            for phase in (engine_pb2.ENGINE_PHASE_LOADING, engine_pb2.ENGINE_PHASE_WARMING_UP):
                await _beat(pub, phase, 0.3)
                assert link.conn.heartbeat.phase == phase
                assert not link.conn.up and not link.up and connects == []
            with pytest.raises(EngineUnavailable):
                await link.command(engine_pb2.ADAPTER_COMMAND_KIND_LOAD, "a", "/x",
                                   connect_wait_s=0.2)
            await _beat(pub, engine_pb2.ENGINE_PHASE_SERVING, 0.3)
            assert link.up and connects == ["e"]
        finally:
            await link.close()
            pub.close(0)
            ctx.term()
    asyncio.run(run())
