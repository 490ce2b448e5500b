"""The control plane's link to an engine: adapter commands awaiting acks, events, and
(re)connect notifications so the desired state can be replayed."""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

from loramux_core.v1 import engine_pb2
from loramux_services.common.engine_connection import EngineConnection

_SEND_RETRY_S = 2.0


class EngineUnavailable(RuntimeError):
    """The engine is down, restarted mid-command, or did not answer in time."""


class EngineLink:
    def __init__(self, input_address: str, output_address: str, *,
                 on_connect: Callable[[str], Awaitable[None]],
                 on_event: Callable[[engine_pb2.EngineEvent], None],
                 on_down: Callable[[str], None] = lambda reason: None,
                 heartbeat_timeout_s: float = 1.5, keys=None):
        self._on_connect = on_connect
        self._on_down = on_down
        self._on_event = on_event
        self._pending: dict[str, asyncio.Future] = {}
        self._tasks: set[asyncio.Task] = set()
        self.last_event = engine_pb2.EngineEvent()
        self._connected = asyncio.Event()
        self.conn = EngineConnection(input_address, output_address, on_output=self._output,
                                     on_up=self._up, on_down=self._down,
                                     heartbeat_timeout_s=heartbeat_timeout_s, keys=keys)

    @property
    def up(self) -> bool:
        return self.conn.up

    async def start(self) -> None:
        await self.conn.start()

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await self.conn.close()

    async def command(self, kind: int, name: str, path: str = "", pinned: bool = False,
                      version: str = "", timeout_s: float = 60.0, connect_wait_s: float = 5.0) -> engine_pb2.AdapterAck:
        """Send one adapter command and wait for its ack (raises EngineUnavailable). An
        engine that is (re)starting gets `connect_wait_s` to send its first heartbeat."""
        if not self.conn.up:
            try:
                await asyncio.wait_for(self._connected.wait(), connect_wait_s)
            except asyncio.TimeoutError:
                raise EngineUnavailable("the engine is not connected") from None
        cmd_id = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        self._pending[cmd_id] = fut
        msg = engine_pb2.EngineInput(adapter_command=engine_pb2.AdapterCommand(
            command_id=cmd_id, kind=kind, name=name, path=path, pinned=pinned, version=version))
        try:
            if not await self._send(msg):
                raise EngineUnavailable("the engine is not connected")
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"the engine did not acknowledge within {timeout_s} s") from None
        finally:
            self._pending.pop(cmd_id, None)

    async def _send(self, msg: engine_pb2.EngineInput) -> bool:
        """Send while the engine is up, retrying for up to _SEND_RETRY_S: a restarted
        engine's first heartbeat (its output socket) can arrive before this side's input
        socket has reconnected to it (ZMQ retries every 100 ms), and the replay that the
        heartbeat starts must not fail for that."""
        deadline = asyncio.get_running_loop().time() + _SEND_RETRY_S
        while not self.conn.send(msg):
            if not self.conn.up or asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def _output(self, msg: engine_pb2.EngineOutput) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "adapter_ack":
            fut = self._pending.get(msg.adapter_ack.command_id)
            if fut is not None and not fut.done():
                fut.set_result(msg.adapter_ack)
        elif kind == "event":
            self.last_event = msg.event
            self._on_event(msg.event)

    def _up(self, instance_id: str) -> None:
        self._connected.set()
        task = asyncio.get_running_loop().create_task(self._on_connect(instance_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _down(self, reason: str) -> None:
        self._on_down(reason)
        self._connected.clear()
        self.last_event = engine_pb2.EngineEvent()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(EngineUnavailable(reason))
