"""Running one workload two ways: through the service (gateway over gRPC, asyncio client
SDK, open loop at the workload's arrival times or a closed loop of C streams) and through
the offline engine in this process (the same arrivals or loop, driven by Engine.step).
Both return one Record per request and the run's wall time."""
from __future__ import annotations

import asyncio
import time

from benchmarks.serving.workload import Record, Request


def _record(req: Request) -> Record:
    return Record(req.index, req.adapter, len(req.prompt))


def _on_tokens(rec: Record, n: int, now: float, last: float | None) -> float:
    """Book `n` tokens arriving at `now`; returns the new time of the last token."""
    if rec.first_s is None:
        rec.first_s = now
        rec.gaps.extend([0.0] * (n - 1))
    elif last is not None:
        rec.gaps.extend([(now - last) / n] * n)
    rec.tokens += n
    return now


# ---- the service -----------------------------------------------------------------------

async def _stream(client, req: Request, rec: Record) -> None:
    from loramux import LoramuxError

    rec.sent_s = time.perf_counter()
    last = None
    try:
        async for resp in client.stream(list(req.prompt), req.adapter, temperature=0.0,
                                        max_tokens=req.max_tokens, ignore_eos=True):
            if resp.token_ids:
                last = _on_tokens(rec, len(resp.token_ids), time.perf_counter(), last)
        rec.end_s = time.perf_counter()
    except LoramuxError as err:
        rec.error = err.code.name if err.code is not None else "ERROR"


async def _drive(gateway: str, workload: list[Request], concurrency: int | None,
                 channels: int) -> tuple[list[Record], float]:
    from loramux.aio import AsyncGenerateClient

    # no SDK retries: a refused call is counted as an error, not hidden in its latency
    clients = [AsyncGenerateClient(gateway, retry=False) for _ in range(channels)]
    records = [_record(r) for r in workload]
    t0 = time.perf_counter()
    try:
        if concurrency is None:
            tasks = []
            for req, rec in zip(workload, records):
                delay = t0 + req.arrival_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(_stream(clients[req.index % channels], req, rec)))
            await asyncio.gather(*tasks)
        else:
            queue = iter(zip(workload, records))

            async def worker(k: int):
                for req, rec in queue:
                    await _stream(clients[k % channels], req, rec)
            await asyncio.gather(*(worker(k) for k in range(concurrency)))
        return records, time.perf_counter() - t0
    finally:
        for c in clients:
            await c.close()


def run_service(gateway: str, workload: list[Request], concurrency: int | None,
                channels: int = 4) -> tuple[list[Record], float]:
    return asyncio.run(_drive(gateway, workload, concurrency, channels))


# ---- the offline engine ----------------------------------------------------------------

def run_offline(engine, workload: list[Request], concurrency: int | None) -> tuple[list[Record], float]:
    """The same requests through `engine` (adapters already added): arrivals honoured on
    the wall clock (open loop) or `concurrency` kept in flight (closed loop)."""
    from engine import SamplingParams

    records = {f"r{r.index}": _record(r) for r in workload}
    last: dict[str, float | None] = {}
    waiting = list(workload)
    t0 = time.perf_counter()

    def admit(req: Request) -> None:
        rid = f"r{req.index}"
        records[rid].sent_s = time.perf_counter()
        last[rid] = None
        engine.add_request(rid, list(req.prompt), SamplingParams(
            temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True), req.adapter)

    while waiting or engine.has_unfinished():
        now = time.perf_counter() - t0
        while waiting and (waiting[0].arrival_s <= now if concurrency is None
                           else len(last) < concurrency):
            admit(waiting.pop(0))
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(waiting[0].arrival_s - now, 0.05)))
            continue
        for out in engine.step():
            rec = records[out.request_id]
            if out.new_token_ids:
                last[out.request_id] = _on_tokens(rec, len(out.new_token_ids),
                                                  time.perf_counter(), last[out.request_id])
            if out.finished:
                rec.end_s = time.perf_counter()
                if out.finish_reason == "error":
                    rec.error = "ERROR"
                del last[out.request_id]
    return [records[f"r{r.index}"] for r in workload], time.perf_counter() - t0
