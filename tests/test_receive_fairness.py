"""The services' ZMQ receive loops yield to the event loop per message: pyzmq's asyncio recv
completes without yielding when a message is already queued, so a flood of engine output
would otherwise starve every other task (the heartbeat watchdog, the adapter-table
publisher, gRPC handlers)."""
from __future__ import annotations

import asyncio

import zmq

from loramux_core.v1 import engine_pb2
from loramux_services.common.engine_connection import EngineConnection

FLOOD = 100_000


def _heartbeat(instance: str) -> bytes:
    return engine_pb2.EngineOutput(instance_id=instance, heartbeat=engine_pb2.Heartbeat(
        instance_id=instance, phase=engine_pb2.ENGINE_PHASE_SERVING)).SerializeToString()


def test_a_flood_of_engine_output_does_not_starve_the_loop():
    """Counted in turns, not time: the other task's turns while the connection reads the
    whole flood (a heartbeat sent after it marks its end), so a slow or stalled machine
    changes nothing."""
    async def run():
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        conn = EngineConnection(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port}",
                                on_output=lambda msg: None)
        await conn.start()
        while conn.instance_id != "joined":   # the slow joiner: until the SUB side reads
            pub.send(_heartbeat("joined"))
            await asyncio.sleep(0.05)
        raw = engine_pb2.EngineOutput(instance_id="other").SerializeToString()
        for _ in range(FLOOD):              # queued before the loop gets to read any
            pub.send(raw)
        pub.send(_heartbeat("end"))         # read only after the whole flood
        ticks = 0
        while conn.instance_id != "end":
            await asyncio.sleep(0)
            ticks += 1
        await conn.close()
        pub.close(0)
        ctx.term()
        return ticks
    # starved, this loop gets a handful of turns while the flood is read; with the receive
    # loop yielding per message it gets about one per message read
    ticks = asyncio.run(run())
    assert ticks > FLOOD // 2, ticks
