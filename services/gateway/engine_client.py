"""The gateway's side of the engine replicas: one asyncio queue per live request, fed from
its replica's per-step StepBatch; routing (services/gateway/router.py); admission control;
aborts; per-replica liveness.

Each queue receives RequestDelta messages and, on failure, a Rejected (the engine refused
the request, or its replica went down: UNAVAILABLE). A replica that goes down ends only
its own streams; new requests go to the others until it is back."""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import grpc
from loramux.v1 import generate_pb2

from loramux_core.v1 import engine_pb2
from services.common.engine_connection import EngineConnection
from services.gateway.errors import Rejected
from services.gateway.router import ReplicaView, choose


class Replica:
    """One engine replica: its connection, its latest stats and this gateway's requests
    on it."""

    def __init__(self, index: int, conn: EngineConnection):
        self.index = index
        self.conn = conn
        self.last_event: engine_pb2.EngineEvent | None = None  # its latest stats snapshot
        self.streams: set[str] = set()
        self.sent = 0  # requests sent since last_event (not counted in it yet)

    @property
    def up(self) -> bool:
        return self.conn.up

    def view(self) -> ReplicaView:
        ev = self.last_event or engine_pb2.EngineEvent()
        return ReplicaView(self.index, {a.name: a.residency for a in ev.adapters},
                           ev.waiting_requests, self.sent, len(self.streams))


class EngineClient:
    def __init__(self, engines: list[tuple[str, str]], *, max_inflight: int,
                 heartbeat_timeout_s: float = 1.5, keys=None, spill_waiting: int = 4,
                 on_route: Callable[[int, str], None] = lambda replica, decision: None,
                 replayed: Callable[[int, str], bool] = lambda replica, instance: True):
        """`engines`: (input, output) address pairs, one per replica, by replica index.
        `on_route(replica, decision)` is told every routing decision. `replayed(replica,
        instance_id)`: that engine got its adapters replayed (AdapterTable.replayed)."""
        self._replayed = replayed
        self.max_inflight = max_inflight
        self.spill_waiting = spill_waiting
        self.prefix = f"gw-{uuid.uuid4().hex[:12]}-"  # request ids unique across gateways
        self._streams: dict[str, tuple[Replica, asyncio.Queue]] = {}
        self._counter = 0
        self._on_route = on_route
        self.draining = False  # set on shutdown: new requests are refused, live ones go on
        self.replicas: list[Replica] = []
        for index, (input_address, output_address) in enumerate(engines):
            conn = EngineConnection(
                input_address, output_address, heartbeat_timeout_s=heartbeat_timeout_s,
                keys=keys, on_output=lambda msg, i=index: self._output(self.replicas[i], msg),
                on_down=lambda reason, i=index: self._down(self.replicas[i], reason))
            self.replicas.append(Replica(index, conn))

    @property
    def inflight(self) -> int:
        return len(self._streams)

    @property
    def up(self) -> bool:
        """True while at least one replica is up."""
        return any(r.up for r in self.replicas)

    @property
    def heartbeat(self) -> engine_pb2.Heartbeat:
        """A live replica's latest heartbeat (model limits are the same on all)."""
        for r in self.replicas:
            if r.up:
                return r.conn.heartbeat
        return self.replicas[0].conn.heartbeat

    async def start(self) -> None:
        for r in self.replicas:
            await r.conn.start()

    async def close(self) -> None:
        for r in self.replicas:
            await r.conn.close()

    def open(self, adapter: str = "", placement: tuple[int, ...] = ()) -> tuple[str, asyncio.Queue]:
        """Admit a new request for `adapter` ("" = base model), placed on the replicas
        `placement` (() = every replica): its engine request id and queue, or Rejected."""
        if self.draining:
            raise Rejected(grpc.StatusCode.UNAVAILABLE,
                           "the gateway is shutting down; retry on another one")
        if len(self._streams) >= self.max_inflight:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"the gateway is at its admission limit ({self.max_inflight} "
                           "requests in flight); retry later")
        replica = self._route(adapter, placement)
        self._counter += 1
        rid = f"{self.prefix}{self._counter}"
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (replica, queue)
        replica.streams.add(rid)
        return rid, queue

    def _route(self, adapter: str, placement: tuple[int, ...]) -> Replica:
        allowed = set(placement) if placement else None
        live = [r.view() for r in self.replicas
                if r.up and r.conn.writable and (allowed is None or r.index in allowed)
                and (not adapter or self._replayed(r.index, r.conn.instance_id))]
        choice = choose(live, adapter, self.spill_waiting)
        if choice is None:
            if not self.up:
                raise Rejected(grpc.StatusCode.UNAVAILABLE, "the engine is unavailable")
            raise Rejected(grpc.StatusCode.UNAVAILABLE,
                           f"no engine replica that holds adapter {adapter!r} is available "
                           f"(placed on replicas {sorted(placement)})")
        self._on_route(choice.replica, choice.decision)
        return self.replicas[choice.replica]

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no request is in flight, or `timeout_s`; True if none is left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self._streams

    def submit(self, rid: str, prompt_ids: list[int], adapter: str,
               sampling: generate_pb2.SamplingParams) -> None:
        replica = self._streams[rid][0]
        msg = engine_pb2.EngineInput(generate=engine_pb2.EngineGenerate(
            request_id=rid, prompt_token_ids=prompt_ids, adapter=adapter, sampling=sampling))
        if not replica.conn.send(msg):
            raise Rejected(grpc.StatusCode.UNAVAILABLE, "the engine is unavailable")
        replica.sent += 1

    def release(self, rid: str, abort: bool) -> None:
        """Forget `rid`; with abort, tell its engine to stop it and free its KV."""
        replica, _ = self._streams.pop(rid, (None, None))
        if replica is None:
            return
        replica.streams.discard(rid)
        if abort:
            replica.conn.send(engine_pb2.EngineInput(abort=engine_pb2.EngineAbort(request_ids=[rid])))

    def _output(self, replica: Replica, msg: engine_pb2.EngineOutput) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "event":
            replica.last_event = msg.event
            replica.sent = 0
        if kind != "step_batch":
            return
        orphans = []
        for d in msg.step_batch.deltas:
            entry = self._streams.get(d.request_id)
            if entry is not None and entry[0] is replica:
                entry[1].put_nowait(d)
            elif not d.finished and d.request_id.startswith(self.prefix):
                orphans.append(d.request_id)  # its caller is gone: make sure it stops
        for err in msg.step_batch.errors:
            entry = self._streams.get(err.request_id)
            if entry is not None and entry[0] is replica:
                entry[1].put_nowait(Rejected.from_wire(err.code, err.message))
        if orphans:
            replica.conn.send(engine_pb2.EngineInput(abort=engine_pb2.EngineAbort(request_ids=orphans)))

    def _down(self, replica: Replica, reason: str) -> None:
        replica.last_event = None
        replica.sent = 0
        what = "engine" if len(self.replicas) == 1 else f"engine replica {replica.index}"
        for rid in replica.streams:
            self._streams[rid][1].put_nowait(
                Rejected(grpc.StatusCode.UNAVAILABLE, f"{what} unavailable: {reason}"))
