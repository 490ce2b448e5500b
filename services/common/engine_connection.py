"""An asyncio connection to one engine: PUSH to its input socket, SUB to its output.

Liveness comes from heartbeats: no heartbeat for `heartbeat_timeout_s` means the engine is
down; a heartbeat with a new instance id means it restarted (everything it held is gone).
An engine is up only while its latest heartbeat says it is serving: one that beats while
it loads or warms up is alive but takes nothing yet. Going down is reported through
`on_down`, and the next serving heartbeat through `on_up`.

The silence is counted only while this process runs: when the watchdog itself wakes late
(this process was descheduled, paused or busy), the heartbeats sent meanwhile are still
unread in the socket, so that time is not held against the engine."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from loramux_core.curve import ZmqKeys
from loramux_core.v1 import engine_pb2


_WATCHDOG_PERIOD_S = 0.05


def _phase_name(phase: int) -> str:
    try:
        return engine_pb2.EnginePhase.Name(phase).removeprefix("ENGINE_PHASE_")
    except ValueError:
        return str(phase)


class EngineConnection:
    def __init__(self, input_address: str, output_address: str, *,
                 on_output: Callable[[engine_pb2.EngineOutput], None],
                 on_up: Callable[[str], None] = lambda instance: None,
                 on_down: Callable[[str], None] = lambda reason: None,
                 heartbeat_timeout_s: float = 1.5, keys: ZmqKeys | None = None):
        self.input_address = input_address
        self.output_address = output_address
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._on_output, self._on_up, self._on_down = on_output, on_up, on_down
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.IMMEDIATE, 1)  # never queue for an engine not connected
        self._push.setsockopt(zmq.SNDHWM, 100_000)
        self._sub = self._actx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        if keys is not None:  # the engine admits only the run's client key
            keys.connect(self._push)
            keys.connect(self._sub)
        self.up = False
        self.instance_id = ""
        self.heartbeat = engine_pb2.Heartbeat()
        self._last_heartbeat = 0.0
        self._own_stall_s = 0.0  # time since the last heartbeat this process was not running
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._push.connect(self.input_address)
        self._sub.connect(self.output_address)
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._push.close(0)
        self._sub.close(0)
        self._ctx.term()
        self._actx.term()

    @property
    def writable(self) -> bool:
        """The input socket has a connection that takes a message now (a restarted
        engine's heartbeats can arrive before this side has reconnected to its input)."""
        return bool(self._push.poll(0, zmq.POLLOUT))

    def send(self, msg: engine_pb2.EngineInput) -> bool:
        """Send without blocking; False when the engine is down or not connected."""
        if not self.up:
            return False
        try:
            self._push.send(msg.SerializeToString(), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    async def _receive(self) -> None:
        while True:
            raw = await self._sub.recv()
            # a recv that finds a message queued completes without yielding: without this, a
            # flood of engine output would starve every other task on the loop (heartbeat
            # watchdog, table publisher, gRPC handlers)
            await asyncio.sleep(0)
            try:
                msg = engine_pb2.EngineOutput.FromString(raw)
            except Exception:  # noqa: BLE001 - ignore garbage, keep serving
                continue
            if msg.WhichOneof("kind") == "heartbeat":
                self._heartbeat(msg.heartbeat)
            elif msg.instance_id == self.instance_id and self.up:
                self._on_output(msg)

    def _heartbeat(self, hb: engine_pb2.Heartbeat) -> None:
        self._last_heartbeat = time.monotonic()
        self._own_stall_s = 0.0
        self.heartbeat = hb
        if hb.instance_id != self.instance_id:
            if self.up:
                self.up = False
                self._on_down(f"engine restarted (instance {self.instance_id} -> {hb.instance_id})")
            self.instance_id = hb.instance_id
        serving = hb.phase == engine_pb2.ENGINE_PHASE_SERVING
        if self.up and not serving:
            self.up = False
            self._on_down(f"engine left serving (phase {_phase_name(hb.phase)})")
        elif serving and not self.up:
            self.up = True
            self._on_up(hb.instance_id)

    async def _watch(self) -> None:
        tick = time.monotonic()
        while True:
            await asyncio.sleep(_WATCHDOG_PERIOD_S)
            now = time.monotonic()
            late = now - tick - _WATCHDOG_PERIOD_S
            if late > _WATCHDOG_PERIOD_S:  # a stall of this process, not scheduling jitter
                self._own_stall_s += late
            tick = now
            silent = now - self._last_heartbeat - self._own_stall_s
            if self.up and silent > self.heartbeat_timeout_s:
                self.up = False
                self._on_down(f"no heartbeat from the engine for {silent:.1f} s")
