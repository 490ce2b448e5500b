"""Publishes the adapter table (what each name may serve now) to gateways over ZMQ PUB:
at once on every change and every `interval_s`, so a gateway that (re)connects, or a
control plane that restarts, converges within one interval."""
from __future__ import annotations

import asyncio

import zmq


from loramux_core.curve import ZmqKeys, start_authenticator
from loramux_core.v1 import engine_pb2
from services.control.registry import AdapterRecord


class TablePublisher:
    def __init__(self, address: str, interval_s: float = 0.5, keys: ZmqKeys | None = None):
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

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._periodic())

    def publish(self, records: list[AdapterRecord]) -> None:
        """Replace the table with `records` and send it now."""
        table = engine_pb2.AdapterTable(version=self._table.version + 1)
        for r in records:
            table.entries.add(name=r.name, state=r.state, pinned=r.pinned, id=r.adapter_id,
                              path=r.path, replicas=r.replicas)
        self._table = table
        self._send()

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
