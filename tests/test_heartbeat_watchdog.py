"""services/common/engine_connection.py's heartbeat watchdog over a real ZMQ PUB/SUB pair:
an engine that stops beating is taken for dead after the timeout, but a stall of the
watching process itself (its event loop not running: descheduled on a loaded machine,
paused, or busy) is not held against the engine, whose heartbeats wait in the socket.
An engine that beats while it loads or warms up is alive but not up (nothing is routed to
it) until a heartbeat says it serves, and one that leaves serving is down at once."""
from __future__ import annotations

import asyncio
import time

import zmq

from loramux_core.v1 import engine_pb2
from loramux_services.common.engine_connection import EngineConnection

TIMEOUT = 0.5


def _heartbeat(seq: int, phase: int = engine_pb2.ENGINE_PHASE_SERVING) -> bytes:
    return engine_pb2.EngineOutput(instance_id="e", heartbeat=engine_pb2.Heartbeat(
        instance_id="e", seq=seq, phase=phase)).SerializeToString()


async def _connected(downs: list):
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    conn = EngineConnection(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port}",
                            on_output=lambda msg: None, on_down=downs.append,
                            heartbeat_timeout_s=TIMEOUT)
    await conn.start()
    while not conn.up:  # the slow joiner
        pub.send(_heartbeat(0))
        await asyncio.sleep(0.01)
    return ctx, pub, conn


async def _beat_until_seen(pub, conn, seq: int,
                           phase: int = engine_pb2.ENGINE_PHASE_SERVING) -> None:
    while conn.heartbeat.seq < seq:
        pub.send(_heartbeat(seq, phase))
        await asyncio.sleep(0.01)


def test_a_stall_of_the_watching_process_is_not_the_engines_silence():
    async def run():
        downs: list = []
        ctx, pub, conn = await _connected(downs)
        try:
            await _beat_until_seen(pub, conn, 1)
            time.sleep(3 * TIMEOUT)  # the loop does not run; the engine beats on meanwhile
            pub.send(engine_pb2.EngineOutput(instance_id="e").SerializeToString())
            pub.send(_heartbeat(2))  # read after the output before it
            await _beat_until_seen(pub, conn, 2)
            return downs, conn.up
        finally:
            await conn.close()
            pub.close(0)
            ctx.term()
    downs, up = asyncio.run(run())
    assert downs == [] and up


def test_an_engine_that_stops_beating_is_down_after_the_timeout():
    async def run():
        downs: list = []
        ctx, pub, conn = await _connected(downs)
        try:
            await _beat_until_seen(pub, conn, 1)
            t0 = time.monotonic()
            while conn.up:  # no more heartbeats
                assert time.monotonic() - t0 < 60, "never taken for dead"
                await asyncio.sleep(0.01)
            return downs
        finally:
            await conn.close()
            pub.close(0)
            ctx.term()
    downs = asyncio.run(run())
    assert len(downs) == 1 and "no heartbeat" in downs[0], downs


def test_only_a_serving_heartbeat_makes_the_engine_up():
    async def run():
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        ups, downs = [], []
        conn = EngineConnection(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port}",
                                on_output=lambda msg: None, on_up=ups.append,
                                on_down=downs.append, heartbeat_timeout_s=TIMEOUT)
        await conn.start()
        try:
            seen = []
            for seq, phase in enumerate((engine_pb2.ENGINE_PHASE_LOADING,
                                         engine_pb2.ENGINE_PHASE_WARMING_UP,
                                         engine_pb2.ENGINE_PHASE_SERVING,
                                         engine_pb2.ENGINE_PHASE_WARMING_UP), start=1):
                await _beat_until_seen(pub, conn, seq, phase)
                seen.append(conn.up)
            return seen, ups, downs
        finally:
            await conn.close()
            pub.close(0)
            ctx.term()
    seen, ups, downs = asyncio.run(run())
    assert seen == [False, False, True, False]
    assert ups == ["e"] and len(downs) == 1 and "WARMING_UP" in downs[0], (ups, downs)
