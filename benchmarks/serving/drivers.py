"""Running one workload two ways: through the service (gateway over gRPC, asyncio client
SDK, open loop at the workload's arrival times or a closed loop of C streams) and through
the offline engine in this process (the same arrivals or loop, driven by Engine.step).
Both return one Record per request and the run's wall time.

A run can be bounded (Limits): no request is sent after `send_s` seconds (arrivals later
than that stay unsent, a closed loop stops taking new ones), and requests still running
`drain_s` seconds after that are cancelled (marked `cut`). So one point never takes more
than send_s + drain_s, whatever the system under test does.

A windowed run (Limits.warm_s set) is measured only from warm_s to send_s (workload.
summarize_window): the first warm_s seconds are its own warm-up, and the drain only waits
until every request sent in the window has its first token, then cancels what still runs.
`marks` (seconds from the start) call `on_mark(k)` on a thread at those times (the
engine's counters and the processes' CPU time at the window's edges); the results come
back in order. Every time in a Record is in seconds from the run's start."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from benchmarks.serving.workload import Record, Request


@dataclass(frozen=True)
class Limits:
    send_s: float = float("inf")   # no request is sent later than this into the run
    drain_s: float = float("inf")  # then: what still runs this much later is cancelled
    warm_s: float | None = None    # windowed: the window is [warm_s, send_s)

    @property
    def total_s(self) -> float:
        return self.send_s + self.drain_s


NO_LIMITS = Limits()


def _record(req: Request) -> Record:
    return Record(req.index, req.adapter, len(req.prompt))


def _on_tokens(rec: Record, n: int, now: float, last: float | None) -> float:
    """Book `n` tokens arriving at `now`; returns the new time of the last token."""
    rec.chunks.append((now, n))
    if rec.first_s is None:
        rec.first_s = now
        rec.gaps.extend([0.0] * (n - 1))
    elif last is not None:
        rec.gaps.extend([(now - last) / n] * n)
    rec.tokens += n
    return now


# ---- the service -----------------------------------------------------------------------

async def _stream(client, req: Request, rec: Record, t0: float) -> None:
    from loramux import LoramuxError

    rec.sent_s = time.perf_counter() - t0
    last = None
    try:
        async for resp in client.stream(list(req.prompt), req.adapter, temperature=0.0,
                                        max_tokens=req.max_tokens, ignore_eos=True):
            if resp.token_ids:
                last = _on_tokens(rec, len(resp.token_ids), time.perf_counter() - t0, last)
        rec.end_s = time.perf_counter() - t0
    except LoramuxError as err:
        rec.error = err.code.name if err.code is not None else "ERROR"


async def _drive(gateway: str, workload: list[Request], concurrency: int | None,
                 channels: int, limits: Limits, marks: Sequence[float],
                 on_mark: Callable[[int], object] | None) -> tuple[list[Record], float, list]:
    from loramux.aio import AsyncGenerateClient

    # no SDK retries: a refused call is counted as an error, not hidden in its latency
    clients = [AsyncGenerateClient(gateway, retry=False) for _ in range(channels)]
    records = [_record(r) for r in workload]
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()

    def sending() -> bool:
        return time.perf_counter() - t0 < limits.send_s

    started = [False] * len(marks)

    async def mark(k: int, at_s: float):
        try:
            await asyncio.sleep(max(0.0, t0 + at_s - time.perf_counter()))
        except asyncio.CancelledError:
            pass  # the run ended first: its mark now
        started[k] = True
        return await loop.run_in_executor(None, on_mark, k)

    marking = [asyncio.create_task(mark(k, at)) for k, at in enumerate(marks)] \
        if on_mark is not None else []
    try:
        tasks = []
        if concurrency is None:
            for req, rec in zip(workload, records):
                if req.arrival_s >= limits.send_s:
                    break
                delay = t0 + req.arrival_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(
                    _stream(clients[req.index % channels], req, rec, t0)))
        else:
            queue = iter(zip(workload, records))

            async def worker(k: int):
                for req, rec in queue:
                    if not sending():
                        return
                    await _stream(clients[k % channels], req, rec, t0)
            tasks = [asyncio.create_task(worker(k)) for k in range(concurrency)]
        if tasks:
            await _until_done(tasks, records, limits, t0)
        wall = time.perf_counter() - t0
        _mark_cut(records)
        for k, m in enumerate(marking):
            if not started[k]:
                m.cancel()
        return records, wall, [await m for m in marking]
    finally:
        for m in marking:
            m.cancel()
        for c in clients:
            await c.close()


def _window_served(records: list[Record], limits: Limits) -> bool:
    """Every request sent in the window (and not failed) has its first token."""
    return all(r.first_s is not None or r.error is not None for r in records
               if r.sent and r.sent_s >= limits.warm_s)


async def _until_done(tasks, records: list[Record], limits: Limits, t0: float) -> None:
    """Wait for `tasks` until the limits: total_s after t0, or (windowed) once the sending
    has stopped and the window's requests all have a first token; then cancel the rest."""
    pending = set(tasks)
    while pending:
        left = t0 + limits.total_s - time.perf_counter()
        if left <= 0:
            break
        windowed = limits.warm_s is not None
        _, pending = await asyncio.wait(pending, timeout=min(left, 0.05) if windowed else
                                        None if left == float("inf") else left)
        if windowed and time.perf_counter() - t0 >= limits.send_s and \
                _window_served(records, limits):
            break
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def _mark_cut(records: list[Record]) -> None:
    for rec in records:
        if rec.sent and rec.end_s is None and rec.error is None:
            rec.cut = True


def run_service(gateway: str, workload: list[Request], concurrency: int | None,
                limits: Limits = NO_LIMITS, channels: int = 4) -> tuple[list[Record], float]:
    records, wall, _ = asyncio.run(_drive(gateway, workload, concurrency, channels, limits,
                                          (), None))
    return records, wall


def run_service_marked(gateway: str, workload: list[Request], concurrency: int | None,
                       limits: Limits, marks: Sequence[float], on_mark: Callable[[int], object],
                       channels: int = 4) -> tuple[list[Record], float, list]:
    """run_service, calling on_mark(k) on a thread at each of `marks` (seconds from the
    start; a mark the run did not reach is called when it ends): (records, wall, the
    on_mark results in order)."""
    return asyncio.run(_drive(gateway, workload, concurrency, channels, limits, marks,
                              on_mark))


# ---- the offline engine ----------------------------------------------------------------

def run_offline(engine, workload: list[Request], concurrency: int | None,
                limits: Limits = NO_LIMITS) -> tuple[list[Record], float]:
    """The same requests through `engine` (adapters already added): arrivals honoured on
    the wall clock (open loop) or `concurrency` kept in flight (closed loop)."""
    from loramux_engine import SamplingParams

    records = {f"r{r.index}": _record(r) for r in workload}
    last: dict[str, float | None] = {}
    waiting = list(workload)
    t0 = time.perf_counter()

    def admit(req: Request) -> None:
        rid = f"r{req.index}"
        records[rid].sent_s = time.perf_counter() - t0
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
                                                  time.perf_counter() - t0, last[out.request_id])
            if out.finished:
                rec.end_s = time.perf_counter() - t0
                if out.finish_reason == "error":
                    rec.error = "ERROR"
                del last[out.request_id]
    return [records[f"r{r.index}"] for r in workload], time.perf_counter() - t0
