"""Running one workload two ways: through the service (gateway over gRPC, asyncio client
SDK, open loop at the workload's arrival times or a closed loop of C streams) and through
the offline engine in this process (the same arrivals or loop, driven by Engine.step).
Both return one Record per request and the run's wall time.

A run can be bounded (Limits): no request is sent after `send_s` seconds (arrivals later
than that stay unsent, a closed loop stops taking new ones), and requests still running
`drain_s` seconds after that are cancelled (marked `cut`). So one point never takes more
than send_s + drain_s, whatever the system under test does."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from benchmarks.serving.workload import Record, Request


@dataclass(frozen=True)
class Limits:
    send_s: float = float("inf")   # no request is sent later than this into the run
    drain_s: float = float("inf")  # then: what still runs this much later is cancelled

    @property
    def total_s(self) -> float:
        return self.send_s + self.drain_s


NO_LIMITS = Limits()


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
                 channels: int, limits: Limits) -> tuple[list[Record], float]:
    from loramux.aio import AsyncGenerateClient

    # no SDK retries: a refused call is counted as an error, not hidden in its latency
    clients = [AsyncGenerateClient(gateway, retry=False) for _ in range(channels)]
    records = [_record(r) for r in workload]
    t0 = time.perf_counter()

    def sending() -> bool:
        return time.perf_counter() - t0 < limits.send_s

    try:
        tasks = []
        if concurrency is None:
            for req, rec in zip(workload, records):
                if req.arrival_s >= limits.send_s:
                    break
                delay = t0 + req.arrival_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(_stream(clients[req.index % channels], req, rec)))
        else:
            queue = iter(zip(workload, records))

            async def worker(k: int):
                for req, rec in queue:
                    if not sending():
                        return
                    await _stream(clients[k % channels], req, rec)
            tasks = [asyncio.create_task(worker(k)) for k in range(concurrency)]
        if tasks:
            left = t0 + limits.total_s - time.perf_counter()
            _, pending = await asyncio.wait(tasks, timeout=None if left == float("inf")
                                            else max(0.0, left))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
        _mark_cut(records)
        return records, wall
    finally:
        for c in clients:
            await c.close()


def _mark_cut(records: list[Record]) -> None:
    for rec in records:
        if rec.sent and rec.end_s is None and rec.error is None:
            rec.cut = True


def run_service(gateway: str, workload: list[Request], concurrency: int | None,
                limits: Limits = NO_LIMITS, channels: int = 4) -> tuple[list[Record], float]:
    return asyncio.run(_drive(gateway, workload, concurrency, channels, limits))


# ---- the offline engine ----------------------------------------------------------------

def run_offline(engine, workload: list[Request], concurrency: int | None,
                limits: Limits = NO_LIMITS) -> tuple[list[Record], float]:
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
        if now >= limits.send_s:
            waiting.clear()
        if now >= limits.total_s:
            for rid in list(last):
                engine.abort(rid)
                records[rid].cut = True
                del last[rid]
        while waiting and (waiting[0].arrival_s <= now if concurrency is None
                           else len(last) < concurrency):
            admit(waiting.pop(0))
        if not engine.has_unfinished():
            if not waiting:
                break
            time.sleep(max(0.0, min(waiting[0].arrival_s - now, 0.05)))
            continue
        for out in engine.step():
            if out.request_id not in last:
                continue  # cut: aborted at the limit
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
