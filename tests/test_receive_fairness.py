"""The services' ZMQ receive loops yield to the event loop per message: pyzmq's asyncio recv
completes without yielding when a message is already queued, so a flood of engine output
would otherwise starve every other task (the heartbeat watchdog, the adapter-table
publisher, gRPC handlers)."""
from __future__ import annotations

import asyncio

import zmq

from loramux_core.v1 import engine_pb2
from services.common.engine_connection import EngineConnection


def test_a_flood_of_engine_output_does_not_starve_the_loop():
    async def run():
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        received = []
        conn = EngineConnection(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port}",
                                on_output=received.append)
        await conn.start()
        await asyncio.sleep(0.3)              # the slow joiner
        raw = engine_pb2.EngineOutput(instance_id="other").SerializeToString()
        for _ in range(100_000):             # queued before the loop gets to read any
            pub.send(raw)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0)
                ticks += 1
        t = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.2)              # well inside the time the flood takes to read
        t.cancel()
        await conn.close()
        pub.close(0)
        ctx.term()
        return ticks
    # starved, the ticker gets a handful of turns while the flood is read; with the receive
    # loop yielding per message it gets one per message read
    assert asyncio.run(run()) > 1000
