"""The gateway's side of the engine replicas: one asyncio queue per live request, fed from
its replica's per-step StepBatch; routing (services/gateway/router.py); admission control;
aborts; per-replica liveness; failover.

Each queue receives RequestDelta messages and, on failure, a Rejected (the engine refused
the request: its status; or no replica could take it: UNAVAILABLE). A replica that goes
down loses no stream while another can take it: each of its requests is sent again to a
live replica, routed as usual (services/gateway/flight.py: re-sent when it had no token
yet, resumed after the tokens already delivered), and its caller sees only the delay.
A request no replica takes within `failover_wait_s` (the replicas it may run on all down)
ends UNAVAILABLE, which callers are told they may retry."""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import grpc
from loramux.v1 import generate_pb2

from loramux_core.v1 import engine_pb2
from loramux_services.common.engine_connection import EngineConnection
from loramux_services.gateway.errors import Rejected
from loramux_services.gateway.flight import Flight
from loramux_services.gateway.router import ReplicaView, choose


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
                 failover_wait_s: float = 2.0,
                 on_route: Callable[[int, str], None] = lambda replica, decision: None,
                 on_failover: Callable[[str], None] = lambda kind: None,
                 replayed: Callable[[int, str], bool] = lambda replica, instance: True):
        """`engines`: (input, output) address pairs, one per replica, by replica index.
        `on_route(replica, decision)` is told every routing decision, `on_failover(kind)`
        every request sent again after its replica went down (flight.RESENT/RESUMED).
        `failover_wait_s`: how long a request whose replica was seen down waits for
        another to take it (so at most the heartbeat timeout and this after the death):
        long enough that replicas that died together are all seen down meanwhile, and
        that one whose heartbeats came back has reconnected its input. `replayed(replica,
        instance_id)`: that engine got its adapters replayed (AdapterTable.replayed); only
        then does it take requests that name an adapter."""
        self._replayed = replayed
        self.max_inflight = max_inflight
        self.spill_waiting = spill_waiting
        self.failover_wait_s = failover_wait_s
        self.prefix = f"gw-{uuid.uuid4().hex[:12]}-"  # request ids unique across gateways
        self._flights: dict[str, Flight] = {}   # by handle
        self._wire: dict[str, Flight] = {}      # by the engine request id of its attempt
        self._stranded: list[Flight] = []       # replica lost, none taken it yet
        self._retry: asyncio.TimerHandle | None = None
        self._counter = 0
        self._on_route = on_route
        self._on_failover = on_failover
        self.draining = False  # set on shutdown: new requests are refused, live ones go on
        self.replicas: list[Replica] = []
        for index, (input_address, output_address) in enumerate(engines):
            conn = EngineConnection(
                input_address, output_address, heartbeat_timeout_s=heartbeat_timeout_s,
                keys=keys, on_output=lambda msg, i=index: self._output(self.replicas[i], msg),
                on_up=lambda instance: self._place_stranded(),
                on_down=lambda reason, i=index: self._down(self.replicas[i], reason))
            self.replicas.append(Replica(index, conn))

    @property
    def inflight(self) -> int:
        return len(self._flights)

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
        if self._retry is not None:
            self._retry.cancel()
        for r in self.replicas:
            await r.conn.close()

    def open(self, adapter: str = "", placement: tuple[int, ...] = ()) -> tuple[str, asyncio.Queue]:
        """Admit a new request for `adapter` ("" = base model), placed on the replicas
        `placement` (() = every replica): its handle and queue, or Rejected."""
        if self.draining:
            raise Rejected(grpc.StatusCode.UNAVAILABLE,
                           "the gateway is shutting down; retry on another one")
        if len(self._flights) >= self.max_inflight:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"the gateway is at its admission limit ({self.max_inflight} "
                           "requests in flight); retry later")
        replica = self._route(adapter, placement)
        if replica is None:
            if not self.up:
                raise Rejected(grpc.StatusCode.UNAVAILABLE, "the engine is unavailable")
            raise Rejected(grpc.StatusCode.UNAVAILABLE,
                           f"no engine replica that holds adapter {adapter!r} is available "
                           f"(placed on replicas {sorted(placement)})")
        self._counter += 1
        flight = Flight(f"{self.prefix}{self._counter}", asyncio.Queue(), adapter, placement)
        self._flights[flight.handle] = flight
        self._attach(flight, replica)
        return flight.handle, flight.queue

    def _route(self, adapter: str, placement: tuple[int, ...]) -> Replica | None:
        allowed = set(placement) if placement else None
        live = [r.view() for r in self.replicas
                if r.up and r.conn.writable and (allowed is None or r.index in allowed)
                and (not adapter or self._replayed(r.index, r.conn.instance_id))]
        choice = choose(live, adapter, self.spill_waiting)
        if choice is None:
            return None
        self._on_route(choice.replica, choice.decision)
        return self.replicas[choice.replica]

    def _attach(self, flight: Flight, replica: Replica) -> None:
        flight.replica = replica
        self._wire[flight.next_attempt()] = flight
        replica.streams.add(flight.handle)

    def _detach(self, flight: Flight) -> None:
        if flight.replica is not None:
            flight.replica.streams.discard(flight.handle)
        self._wire.pop(flight.engine_rid, None)
        flight.replica = None

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no request is in flight, or `timeout_s`; True if none is left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._flights and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self._flights

    def submit(self, handle: str, prompt_ids: list[int], adapter: str,
               sampling: generate_pb2.SamplingParams) -> None:
        """Send the request opened as `handle` to its replica (kept for a failover)."""
        flight = self._flights[handle]
        flight.prompt_ids, flight.sampling = list(prompt_ids), sampling
        if not flight.replica.conn.send(flight.message()):
            raise Rejected(grpc.StatusCode.UNAVAILABLE, "the engine is unavailable")
        flight.replica.sent += 1

    def placement_of(self, handle: str) -> tuple[int | None, int]:
        """(index of the replica `handle` runs on, None while stranded or unknown; attempts
        sent so far): for the request's log line."""
        flight = self._flights.get(handle)
        if flight is None:
            return None, 0
        return (None if flight.replica is None else flight.replica.index), flight.attempts

    def release(self, handle: str, abort: bool) -> None:
        """Forget `handle`; with abort, tell its engine to stop it and free its KV."""
        flight = self._flights.pop(handle, None)
        if flight is None:
            return
        replica, rid = flight.replica, flight.engine_rid
        self._detach(flight)
        if flight in self._stranded:
            self._stranded.remove(flight)
        if abort and replica is not None:
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
            flight = self._wire.get(d.request_id)
            if flight is not None and flight.replica is replica:
                flight.generated.extend(d.token_ids)
                flight.queue.put_nowait(d)
            elif not d.finished and d.request_id.startswith(self.prefix):
                orphans.append(d.request_id)  # its caller is gone: make sure it stops
        for err in msg.step_batch.errors:
            flight = self._wire.get(err.request_id)
            if flight is not None and flight.replica is replica:
                flight.queue.put_nowait(Rejected.from_wire(err.code, err.message))
        if orphans:
            replica.conn.send(engine_pb2.EngineInput(abort=engine_pb2.EngineAbort(request_ids=orphans)))

    def _down(self, replica: Replica, reason: str) -> None:
        """`replica` lost everything it ran: its requests go to the others."""
        replica.last_event = None
        replica.sent = 0
        what = "engine" if len(self.replicas) == 1 else f"engine replica {replica.index}"
        deadline = asyncio.get_running_loop().time() + self.failover_wait_s
        for handle in list(replica.streams):
            flight = self._flights[handle]
            self._detach(flight)
            flight.down_reason, flight.deadline = f"{what} unavailable: {reason}", deadline
            self._stranded.append(flight)
        self._place_stranded()

    def _place_stranded(self) -> None:
        """Send every stranded request to a live replica that may run it; end those whose
        wait is over; look again soon while any is left (a replica's input may take a
        moment to reconnect after its first heartbeat)."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        now = asyncio.get_running_loop().time()
        waiting = []
        for flight in self._stranded:
            if flight.submitted and self._send_again(flight):
                continue
            if now >= flight.deadline:
                self._give_up(flight)
            else:
                waiting.append(flight)
        self._stranded = waiting
        if waiting:
            self._retry = asyncio.get_running_loop().call_later(_RETRY_PERIOD_S,
                                                                self._place_stranded)

    def _send_again(self, flight: Flight) -> bool:
        replica = self._route(flight.adapter, flight.placement)
        if replica is None:
            return False
        self._attach(flight, replica)
        if not replica.conn.send(flight.message()):
            self._detach(flight)
            return False
        replica.sent += 1
        self._on_failover(flight.kind)
        return True

    def _give_up(self, flight: Flight) -> None:
        flight.queue.put_nowait(Rejected(
            grpc.StatusCode.UNAVAILABLE,
            f"{flight.down_reason}; no engine replica could take the request within "
            f"{self.failover_wait_s:.1f} s"))


_RETRY_PERIOD_S = 0.05
