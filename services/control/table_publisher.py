"""Publishes the adapter table (what each name may serve now) to gateways over ZMQ PUB:
soon after every change and every `interval_s`, so a gateway that (re)connects, or a
control plane that restarts, converges within one interval.

The table is whole (every name), so sending it at each change would cost O(names) per
admin call: O(N^2) to load N adapters (7 ms per load at 200 adapters, 23 ms at 800, on
one CPU core). Changes are coalesced instead: `publish_later` sends the registry as it is
then, at most once every `min_gap_s` (a gateway that misses a name waits for the next
tables before refusing it: services/gateway/adapter_table.py), and at most once every
BUSY_FACTOR times what the last such table cost to build and send
(loramux_core/pacing.py), so that with thousands of names and a steady stream of loads
the tables take a bounded share of the event loop (about 1/BUSY_FACTOR) instead of a
share growing with the number of names."""
from __future__ import annotations

import asyncio
import time
from typing import Callable

import zmq

from loramux_core.curve import ZmqKeys, start_authenticator
from loramux_core.pacing import BusyPacer
from loramux_core.v1 import engine_pb2
from loramux_services.control.registry import AdapterRecord


class TablePublisher:
    def __init__(self, address: str, interval_s: float = 0.5, keys: ZmqKeys | None = None,
                 min_gap_s: float = 0.01, replicas: int = 0):
        self._ctx = zmq.Context()
        self._auth = start_authenticator(self._ctx, keys) if keys else None
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        if keys:
            keys.serve(self._pub)
        self._pub.bind(address)
        self.address = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._interval_s = interval_s
        self._table = engine_pb2.AdapterTable()
        self._task: asyncio.Task | None = None
        self._pending: Callable[[], list[AdapterRecord]] | None = None
        self._pacer = BusyPacer(min_gap_s=min_gap_s)  # paces the publish_later tables
        # by replica: the engine instance whose replay ended (the manager sets it)
        self.replayed = [""] * replicas

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._periodic())

    def publish(self, records: list[AdapterRecord]) -> None:
        """Replace the table with `records` and send it now."""
        table = engine_pb2.AdapterTable(version=self._table.version + 1, replayed=self.replayed)
        for r in records:
            table.entries.add(name=r.name, state=r.state, pinned=r.pinned, id=r.adapter_id,
                              path=r.path, replicas=r.replicas)
        self._table = table
        self._send()

    def publish_later(self, records: Callable[[], list[AdapterRecord]]) -> None:
        """A change: send `records()` within `min_gap_s` (one send for the changes made
        meanwhile); at once when no event loop runs."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.publish(records())
            return
        if self._pending is None:
            loop.call_later(max(0.0, self._pacer.next_at() - time.monotonic()), self._flush)
        self._pending = records

    def _flush(self) -> None:
        records, self._pending = self._pending, None
        if records is not None and not self._pub.closed:
            start = time.monotonic()
            self.publish(records())
            self._pacer.ran(start, time.monotonic())

    def _send(self) -> None:
        self._pub.send(self._table.SerializeToString())

    async def _periodic(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            self._send()

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._pub.close(0)
        if self._auth:
            self._auth.stop()
        self._ctx.term()
