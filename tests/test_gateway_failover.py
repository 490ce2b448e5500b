"""The gateway's failover bookkeeping (services/gateway/engine_client.py) against two
scripted engines on real ZMQ sockets: a request whose replica goes silent is re-sent
(no token yet) or resumed (with the tokens its caller has) on the other, under a new
engine request id; the silent replica's late tokens for the old attempt never reach the
caller and are aborted when it is heard again; with no replica left the call ends
UNAVAILABLE after the failover wait."""
from __future__ import annotations

import asyncio

import grpc
import zmq
import zmq.asyncio
from loramux.v1 import generate_pb2

from loramux_core.v1 import engine_pb2
from loramux_services.gateway.engine_client import EngineClient
from loramux_services.gateway.errors import Rejected

HEARTBEAT_TIMEOUT_S = 0.3
FAILOVER_WAIT_S = 0.5


class ScriptedEngine:
    """An engine's two sockets, driven by the test: heartbeats while `beating`."""

    def __init__(self, ctx: zmq.asyncio.Context, name: str):
        self.name = name
        self.pull = ctx.socket(zmq.PULL)
        self.pub = ctx.socket(zmq.PUB)
        self.input = f"tcp://127.0.0.1:{self.pull.bind_to_random_port('tcp://127.0.0.1')}"
        self.output = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.beating = True

    async def beat(self) -> None:
        while True:
            if self.beating:
                await self.send(heartbeat=engine_pb2.Heartbeat(
                    instance_id=self.name, phase=engine_pb2.ENGINE_PHASE_SERVING))
            await asyncio.sleep(0.03)

    async def send(self, **kind) -> None:
        await self.pub.send(engine_pb2.EngineOutput(instance_id=self.name,
                                                    **kind).SerializeToString())

    async def tokens(self, rid: str, ids: list[int], finished: bool = False) -> None:
        await self.send(step_batch=engine_pb2.StepBatch(deltas=[engine_pb2.RequestDelta(
            request_id=rid, token_ids=ids, finished=finished)]))

    async def received(self, timeout_s: float = 5.0) -> engine_pb2.EngineInput:
        raw = await asyncio.wait_for(self.pull.recv(), timeout_s)
        return engine_pb2.EngineInput.FromString(raw)

    def close(self) -> None:
        self.pull.close(0)
        self.pub.close(0)


async def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _run(scenario):
    async def main():
        ctx = zmq.asyncio.Context()
        engines = [ScriptedEngine(ctx, "e0"), ScriptedEngine(ctx, "e1")]
        beats = [asyncio.create_task(e.beat()) for e in engines]
        kinds: list[str] = []
        client = EngineClient([(e.input, e.output) for e in engines], max_inflight=8,
                              heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
                              failover_wait_s=FAILOVER_WAIT_S, on_failover=kinds.append)
        await client.start()
        try:
            await _until(lambda: all(r.up and r.conn.writable for r in client.replicas))
            return await scenario(client, engines, kinds)
        finally:
            for t in beats:
                t.cancel()
            await client.close()
            for e in engines:
                e.close()
            ctx.term()
    return asyncio.run(main())


SAMPLING = generate_pb2.SamplingParams(max_tokens=10, temperature=0.7, seed=5, stop=["x"])


async def _submitted(client, engines):
    """A request opened and sent: its handle, queue, the engine it went to, its message."""
    handle, queue = client.open()
    client.submit(handle, [1, 2, 3], "", SAMPLING)
    first = next(e for e, r in zip(engines, client.replicas) if handle in r.streams)
    msg = await first.received()
    return handle, queue, first, msg.generate


def test_a_stream_is_resumed_with_the_tokens_its_caller_has():
    async def scenario(client, engines, kinds):
        handle, queue, first, gen = await _submitted(client, engines)
        other = engines[1] if first is engines[0] else engines[0]
        assert gen.request_id == handle and list(gen.generated_token_ids) == []
        await first.tokens(handle, [7])
        await first.tokens(handle, [8])
        got = [await queue.get(), await queue.get()]
        first.beating = False  # silent, not dead
        resumed = (await other.received()).generate
        await other.tokens(resumed.request_id, [9], finished=True)
        got.append(await queue.get())
        first.beating = True  # heard again: its late token for the old attempt
        await _until(lambda: all(r.up for r in client.replicas))
        await first.tokens(handle, [99])
        abort = await first.received()
        return handle, got, resumed, abort, queue.qsize(), kinds
    handle, got, resumed, abort, left, kinds = _run(scenario)
    assert [list(d.token_ids) for d in got] == [[7], [8], [9]] and got[-1].finished
    assert resumed.request_id != handle and resumed.request_id.startswith(handle)
    assert list(resumed.prompt_token_ids) == [1, 2, 3]
    assert list(resumed.generated_token_ids) == [7, 8]
    assert resumed.sampling == SAMPLING
    assert list(abort.abort.request_ids) == [handle] and left == 0
    assert kinds == ["resumed"]


def test_a_request_without_a_token_is_resent_as_it_was():
    async def scenario(client, engines, kinds):
        handle, queue, first, gen = await _submitted(client, engines)
        other = engines[1] if first is engines[0] else engines[0]
        first.beating = False
        resent = (await other.received()).generate
        await other.tokens(resent.request_id, [4], finished=True)
        return gen, resent, await queue.get(), kinds
    gen, resent, delta, kinds = _run(scenario)
    assert list(resent.generated_token_ids) == []
    assert (list(resent.prompt_token_ids), resent.sampling) == (list(gen.prompt_token_ids),
                                                                 gen.sampling)
    assert list(delta.token_ids) == [4] and kinds == ["resent"]


def test_no_replica_left_ends_the_call_unavailable_after_the_wait():
    async def scenario(client, engines, kinds):
        handle, queue, first, _ = await _submitted(client, engines)
        await first.tokens(handle, [7])
        await queue.get()
        for e in engines:
            e.beating = False
        loop = asyncio.get_running_loop()
        await _until(lambda: not client.up)
        t_down = loop.time()
        err = await asyncio.wait_for(queue.get(), 10)
        return err, loop.time() - t_down, kinds
    err, waited, kinds = _run(scenario)
    assert isinstance(err, Rejected) and err.code == grpc.StatusCode.UNAVAILABLE, err
    assert "no engine replica could take the request" in str(err)
    assert FAILOVER_WAIT_S - 0.1 <= waited, waited
    # the replica seen down first may hand it to the other, still taken for up a moment
    assert kinds in ([], ["resumed"])
