"""The gateway's adapter table over a real ZMQ PUB/SUB pair: a name refused as unknown or not
loaded is checked against the tables that arrive after the request did, so an admin call
that returned before a Generate is always seen by it."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from loramux.v1 import adapter_admin_pb2 as admin_pb2

from loramux_services.control.registry import AdapterRecord
from loramux_services.control.table_publisher import TablePublisher
from loramux_services.gateway.adapter_table import AdapterTable
from loramux_services.gateway.errors import Rejected


def record(name: str, state: int) -> AdapterRecord:
    return AdapterRecord(name=name, path=f"/adapters/{name}", state=state, adapter_id=7,
                         pinned=False)


async def _table_pair(interval_s: float):
    pub = TablePublisher("tcp://127.0.0.1:*", interval_s=interval_s)
    table = AdapterTable(pub.address)
    await table.start()
    pub.start()
    pub.publish([])
    deadline = time.monotonic() + 30
    while not table.received:  # the slow joiner: until the SUB side has a table
        assert time.monotonic() < deadline, "no table arrived"
        await asyncio.sleep(0.01)
    return pub, table


def test_a_name_published_after_the_request_arrived_is_found():
    async def run():
        pub, table = await _table_pair(interval_s=0.2)
        try:
            with pytest.raises(Rejected):
                table.resolve("fresh")
            waiting = asyncio.ensure_future(table.resolve_current("fresh"))
            await asyncio.sleep(0.05)
            assert not waiting.done()       # it waits for newer tables instead of refusing
            pub.publish([record("fresh", admin_pb2.ADAPTER_STATE_LOADED)])
            entry = await asyncio.wait_for(waiting, 30)
            assert entry.name == "fresh"
        finally:
            await table.close()
            await pub.close()
    asyncio.run(run())


@pytest.mark.parametrize("state,code", [
    (None, grpc.StatusCode.NOT_FOUND),
    (admin_pb2.ADAPTER_STATE_REGISTERED, grpc.StatusCode.FAILED_PRECONDITION)])
def test_refusals_stand_after_two_newer_tables(state, code):
    async def run():
        pub, table = await _table_pair(interval_s=0.1)
        try:
            pub.publish([] if state is None else [record("x", state)])
            t0 = time.monotonic()
            with pytest.raises(Rejected) as info:
                await table.resolve_current("x", wait_s=60.0)
            assert info.value.code == code
            # bounded by two publish intervals (0.2 s), not by wait_s: the margin between
            # them absorbs any stall of a loaded machine
            assert time.monotonic() - t0 < 30.0
        finally:
            await table.close()
            await pub.close()
    asyncio.run(run())


def test_changes_made_together_are_sent_as_one_table_holding_the_last_state():
    """publish_later coalesces: 300 changes in one burst (as concurrent loads make) cost
    one table built from the registry as it is when sent, not 300 whole tables."""
    async def run():
        pub, table = await _table_pair(interval_s=0.2)  # (periodic sends repeat a table)
        try:
            sent_before = pub._table.version
            state: list[AdapterRecord] = []
            for i in range(300):
                state.append(record(f"a{i:03d}", admin_pb2.ADAPTER_STATE_LOADED))
                pub.publish_later(lambda: list(state))
            entry = await asyncio.wait_for(table.resolve_current("a299"), 30)
            assert entry.name == "a299"
            assert len(table.loaded()) == 300
            assert pub._table.version - sent_before == 1
        finally:
            await table.close()
            await pub.close()
    asyncio.run(run())
