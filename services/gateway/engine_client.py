"""The gateway's side of the engine: one asyncio queue per live request, fed from the
engine's per-step StepBatch; admission control; aborts.

Each queue receives RequestDelta messages and, on failure, a Rejected (the engine refused
the request, or went down: UNAVAILABLE)."""
from __future__ import annotations

import asyncio
import uuid

import grpc
from loramux.v1 import generate_pb2

from loramux_core.v1 import engine_pb2
from services.common.engine_connection import EngineConnection
from services.gateway.errors import Rejected


class EngineClient:
    def __init__(self, input_address: str, output_address: str, *, max_inflight: int,
                 heartbeat_timeout_s: float = 1.5, keys=None):
        self.max_inflight = max_inflight
        self.prefix = f"gw-{uuid.uuid4().hex[:12]}-"  # request ids unique across gateways
        self._streams: dict[str, asyncio.Queue] = {}
        self._counter = 0
        self.draining = False  # set on shutdown: new requests are refused, live ones go on
        self.last_event: engine_pb2.EngineEvent | None = None  # the engine's latest snapshot
        self.conn = EngineConnection(input_address, output_address, on_output=self._output,
                                     on_down=self._down, heartbeat_timeout_s=heartbeat_timeout_s,
                                     keys=keys)

    @property
    def inflight(self) -> int:
        return len(self._streams)

    @property
    def up(self) -> bool:
        return self.conn.up

    async def start(self) -> None:
        await self.conn.start()

    async def close(self) -> None:
        await self.conn.close()

    def open(self) -> tuple[str, asyncio.Queue]:
        """Admit a new request: its engine request id and queue, or Rejected."""
        if self.draining:
            raise Rejected(grpc.StatusCode.UNAVAILABLE,
                           "the gateway is shutting down; retry on another one")
        if not self.conn.up:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, "the engine is unavailable")
        if len(self._streams) >= self.max_inflight:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"the gateway is at its admission limit ({self.max_inflight} "
                           "requests in flight); retry later")
        self._counter += 1
        rid = f"{self.prefix}{self._counter}"
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        return rid, queue

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no request is in flight, or `timeout_s`; True if none is left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self._streams

    def submit(self, rid: str, prompt_ids: list[int], adapter: str,
               sampling: generate_pb2.SamplingParams) -> None:
        msg = engine_pb2.EngineInput(generate=engine_pb2.EngineGenerate(
            request_id=rid, prompt_token_ids=prompt_ids, adapter=adapter, sampling=sampling))
        if not self.conn.send(msg):
            raise Rejected(grpc.StatusCode.UNAVAILABLE, "the engine is unavailable")

    def release(self, rid: str, abort: bool) -> None:
        """Forget `rid`; with abort, tell the engine to stop it and free its KV."""
        self._streams.pop(rid, None)
        if abort:
            self.conn.send(engine_pb2.EngineInput(abort=engine_pb2.EngineAbort(request_ids=[rid])))

    def _output(self, msg: engine_pb2.EngineOutput) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "event":
            self.last_event = msg.event
        if kind != "step_batch":
            return
        orphans = []
        for d in msg.step_batch.deltas:
            queue = self._streams.get(d.request_id)
            if queue is not None:
                queue.put_nowait(d)
            elif not d.finished and d.request_id.startswith(self.prefix):
                orphans.append(d.request_id)  # its caller is gone: make sure it stops
        for err in msg.step_batch.errors:
            queue = self._streams.get(err.request_id)
            if queue is not None:
                queue.put_nowait(Rejected.from_wire(err.code, err.message))
        if orphans:
            self.conn.send(engine_pb2.EngineInput(abort=engine_pb2.EngineAbort(request_ids=orphans)))

    def _down(self, reason: str) -> None:
        for queue in self._streams.values():
            queue.put_nowait(Rejected(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {reason}"))
