"""The gateway's copy of the control plane's adapter table (ZMQ SUB), and name resolution.

The last table received stays in force while the control plane is away, so a control
plane restart never disturbs generation."""
from __future__ import annotations

import asyncio

import grpc
import zmq
import zmq.asyncio
from loramux.v1 import adapter_admin_pb2 as admin_pb2


from loramux_core.curve import ZmqKeys
from loramux_core.v1 import engine_pb2
from loramux_services.gateway.errors import Rejected


class AdapterTable:
    def __init__(self, address: str, keys: ZmqKeys | None = None):
        self.address = address
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        if keys is not None:
            keys.connect(self._sub)
        self._entries: dict[str, engine_pb2.AdapterTableEntry] | None = None
        self._replayed: dict[int, str] = {}  # replica -> engine instance replayed last
        self._tracks_replays = False  # a control plane that predates `replayed`: no check
        self._task: asyncio.Task | None = None
        self._received = 0                      # tables taken in, for resolve_current
        self._arrival: asyncio.Condition | None = None

    @property
    def received(self) -> bool:
        return self._entries is not None

    async def start(self) -> None:
        self._arrival = asyncio.Condition()
        self._sub.connect(self.address)
        self._task = asyncio.get_running_loop().create_task(self._receive())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._sub.close(0)
        self._ctx.term()

    def update(self, table: engine_pb2.AdapterTable) -> None:
        self._entries = {e.name: e for e in table.entries}
        # "" (a control plane that restarted and has not replayed yet) keeps what an
        # earlier table said: a control plane restart takes no replica out of traffic
        self._replayed.update((i, v) for i, v in enumerate(table.replayed) if v)
        self._tracks_replays |= len(table.replayed) > 0

    def replayed(self, replica: int, instance_id: str) -> bool:
        """The control plane replayed adapters and pins to engine `instance_id` of
        `replica`: it may take requests that name adapters (a restarted engine holds none
        of them before)."""
        return not self._tracks_replays or self._replayed.get(replica) == instance_id

    async def _receive(self) -> None:
        while True:
            raw = await self._sub.recv()
            await asyncio.sleep(0)  # a queued message completes recv without yielding
            try:
                self.update(engine_pb2.AdapterTable.FromString(raw))
            except Exception:  # noqa: BLE001 - a garbled table is dropped, the old one stays
                continue
            async with self._arrival:
                self._received += 1
                self._arrival.notify_all()

    def resolve(self, name: str) -> engine_pb2.AdapterTableEntry:
        """The entry of adapter `name`; Rejected unless it may take new requests now."""
        if self._entries is None:
            raise Rejected(grpc.StatusCode.UNAVAILABLE,
                           "the adapter table has not been received from the control plane yet")
        entry = self._entries.get(name)
        if entry is None:
            raise Rejected(grpc.StatusCode.NOT_FOUND, f"adapter {name!r} is not registered")
        if entry.state == admin_pb2.ADAPTER_STATE_REGISTERED:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                           f"adapter {name!r} is registered but not loaded")
        if entry.state == admin_pb2.ADAPTER_STATE_UNLOADING:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                           f"adapter {name!r} is being unloaded")
        return entry

    async def resolve_current(self, name: str,
                              wait_s: float = 2.5) -> engine_pb2.AdapterTableEntry:
        """`resolve`, reading the admin calls that returned before this one arrived.

        The table is pushed to gateways, so an adapter registered or loaded a moment ago may
        not be here yet. Before refusing a name as unknown or not loaded, wait for two more
        tables (at most `wait_s`): the second was sent after the first arrived, so after
        this request did, and so after any admin call the client saw complete. The control
        plane sends one at every change and every interval, so this waits one interval or
        two at most, and only on the refusal path."""
        try:
            return self.resolve(name)
        except Rejected as err:
            if err.code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                raise
            if self._arrival is None:
                raise
        async with self._arrival:
            target = self._received + 2
            try:
                await asyncio.wait_for(
                    self._arrival.wait_for(lambda: self._received >= target), wait_s)
            except asyncio.TimeoutError:
                pass
        return self.resolve(name)

    def entries(self) -> list[engine_pb2.AdapterTableEntry]:
        """Every adapter the control plane published, whatever its state."""
        return list((self._entries or {}).values())

    def loaded(self) -> list[engine_pb2.AdapterTableEntry]:
        """Every adapter that takes requests now (LOADED), by name."""
        entries = (self._entries or {}).values()
        return sorted((e for e in entries if e.state == admin_pb2.ADAPTER_STATE_LOADED),
                      key=lambda e: e.name)
