"""Continuous batching with chunked prefill, adapter-capped batches, fairness and preemption.

Each step:
1. Running requests, decodes first, then prefill continuations, each takes
   min(tokens left to compute, budget left). When the pool cannot grow a request's block
   table, the newest running request not yet scheduled this step is preempted (blocks
   freed, full blocks stay matchable in its namespace, it goes back to the front of the
   waiting queue), possibly the request itself.
2. If nothing was preempted, waiting requests are admitted in order while the token
   budget, `max_num_seqs` and the pool allow. A request is deferred (skipped, keeps its
   place, never dropped) when its adapter is not ready in a device slot, when it would
   take the running set past `max_loras` distinct adapters, while a drain pauses it, or
   while its output constraint is still compiling (engine/structured/).

Adapters. The scheduler never assigns or evicts slots: it admits only requests whose
adapter is already ready in a slot (the residency manager copies adapters in after the
batch is fixed, see engine/adapters/residency.py). So every slot of a batch is assigned
before the batch is built and no eviction can touch it. The cap holds for the whole
running set (a superset of every batch); an adapter counts only once a request of it is
actually admitted, so a request that fails to get blocks leaves no trace in the cap.
`wanted_adapters()` tells the residency manager which adapters to bring in, in priority
order: the adapter whose oldest waiting request has waited longest comes first.

Fairness (the drainer). A request "starves" when it has waited at least
`starvation_steps` (K) steps while its adapter is not ready in a slot, not counting the
steps its adapter's disk read is in flight (a drain frees a slot, it cannot hasten a read;
with many adapters reads are common, and drains for them only paused admissions, then let
a burst of prefills in at once). While any request
starves, with t* the step the oldest starving request started waiting, requests of
unpinned adapters that started waiting after t* are not admitted: running requests
finish, the unpinned adapters go idle, and the slot freed first goes to the oldest
starving adapter, whose requests from up to t* are admitted. Base-model and
pinned-adapter requests are never paused: they free no slot by pausing (pins take at
most max_loras - 1 slots, so one always rotates).

Progress across the three tiers (slots, host copies, disk). `wanted_adapters()` is the
priority order; its first adapter without a slot, the head, is the oldest starving
adapter whenever one starves (any adapter ahead of it is ready in a slot and has a
request from up to t*, so it is not paused). The residency manager keeps R1-R3 for the
head (engine/adapters/residency.py): its disk read always has room, its host copy is
displaced by no other adapter's read or traffic, and it takes the first slot that
holds no running, pinned or higher-priority adapter. Bound: with
  D  the most steps an admitted request runs: ceil(S * P / (B - S + 1)) prompt steps
     (S = max_num_seqs, P = the longest prompt, B = max_num_batched_tokens: decodes
     take at most S - 1 tokens of a step) plus max_tokens, plus 1 under async scheduling
     (a finished request holds its cap place until its step is updated);
  L  3 steps to place an adapter once its read has landed (poll into the host tier,
     copy into the slot after that step's batch, admission at the next step);
a request whose adapter is not ready is admitted within K + (A + 1) * (D + L) steps of
its arrival, A being the number of other adapters with a waiting request older than
it, not counting the time disk reads it waits for are in flight (the engine steps on
meanwhile and waits for a read only when nothing else can run) and assuming no
preemption and no wait for `max_num_seqs` or KV blocks (those are FIFO among requests
that may run). An admin pin may displace the head's host copy; each one adds at most
L. tests/test_stress_lifecycle.py checks this bound after every step.

Batch composition when adapters outnumber slots. A slot freed for a waiting adapter
serves all of that adapter's waiting requests, so while nothing starves the adapter
with the most waiting requests is brought in first (`wanted_adapters`): each step runs
as many requests as the slots allow, instead of slots going to adapters in arrival
waves. Fairness is unchanged: once a request has waited K steps without a slot, the
order is by age again and the drain above applies, so the bound holds as stated.

Async scheduling (engine/engine.py launches step N+1 before step N's tokens are known).
`schedule` advances `num_computed_tokens` itself and counts each sampling row as an
in-flight token of its request (`num_inflight_tokens`), so the next schedule runs that
token (a placeholder the device fills in) and never re-schedules what is in flight; a
request whose in-flight token is its last (max_tokens) is not scheduled again. `update`
appends the tokens. A request that finishes (stop, abort) while a launched step still
holds it is "draining": finished for its caller at once, but its KV blocks, its count in
the adapter cap and its `on_release` call wait until the last such step is updated, since
the device may still write its KV and read its slot. A preempted request whose token is in
flight gets that token appended when its step is updated, then recomputes from all its
tokens. In sync use (schedule, run, update) all of this reduces to the usual loop.
"""
from __future__ import annotations

from collections import Counter, deque
from operator import attrgetter
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from loramux_engine.adapters.slots import SlotTable
from loramux_engine.kv.kv_cache_manager import KVCacheManager
from loramux_engine.outputs import FinishReason
from loramux_engine.request import Request, RequestStatus


_arrival = attrgetter("arrival")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_loras: int = 4
    starvation_steps: int = 16  # K: waits this long for a slot start a drain


class ScheduledRequest(NamedTuple):
    """One sequence of a step: `num_new_tokens` tokens from position `start` (a tuple:
    one is built per sequence per step, on every tensor-parallel rank)."""
    request: Request
    start: int
    num_new_tokens: int
    block_ids: tuple[int, ...]
    slot: int      # LoRA slot of its adapter, -1 for the base model
    samples: bool  # this step reaches the request's last token, so it samples one


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    cache_hits: list[tuple[Request, int]] = field(default_factory=list)  # admitted: tokens hit

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Sampled(NamedTuple):
    """What the sampler produced for one request this step."""
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None = None


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, slots: SlotTable,
                 on_release: Callable[[Request], None] | None = None):
        """`on_release(req)` is called once a finished request has let go of its blocks
        (at finish, or when its last launched step is updated)."""
        self.cfg = cfg
        self.kv = kv
        self.slots = slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._adapters = Counter()  # adapter id -> running requests (base excluded)
        self._since: dict[str, int] = {}  # request id -> step it first started waiting
        # request id -> steps it waited without a slot, its adapter's disk reads aside
        self._slotless: Counter = Counter()
        # adapter id -> whether its disk read is in flight (the engine's residency says)
        self.reading: Callable[[int], bool] = lambda adapter_id: False
        # finished, still in a launched step: id -> (request, holds a count in the cap)
        self._draining: dict[str, tuple[Request, bool]] = {}
        self.on_release = on_release
        self.num_steps = 0
        self.num_updates = 0

    # ---- queue management -------------------------------------------------------
    def add(self, req: Request) -> None:
        assert req.request_id not in self._requests
        self._requests[req.request_id] = req
        req.status = RequestStatus.WAITING
        self._since[req.request_id] = self.num_steps
        self.waiting.append(req)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def is_draining(self, request_id: str) -> bool:
        """Finished but still held by a launched step (its id is not free for reuse yet)."""
        return request_id in self._draining

    def draining(self) -> list[Request]:
        """Finished requests whose blocks wait for a launched step to be updated."""
        return [req for req, _ in self._draining.values()]

    def running_adapters(self) -> set[int]:
        return set(self._adapters)

    def abort(self, request_id: str) -> Request | None:
        """Finish a waiting or running request as aborted, freeing all it holds."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        self.finish(req, FinishReason.ABORTED)
        return req

    def finish(self, req: Request, reason: str) -> None:
        """Finish now for the caller; free now, or when the launched steps holding it
        are updated (see the module docstring)."""
        counted = req.status is RequestStatus.RUNNING  # holds a count in the adapter cap
        if counted:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self._requests[req.request_id]
        self._since.pop(req.request_id, None)
        self._slotless.pop(req.request_id, None)
        if req.num_inflight_steps:
            self._draining[req.request_id] = (req, counted)
        else:
            self._release(req, counted)

    def _release(self, req: Request, counted: bool) -> None:
        if counted:
            self._drop_adapter(req)
        self.kv.free(req)
        if self.on_release is not None:
            self.on_release(req)

    # ---- one step ---------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        self._count_slotless()
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.cfg.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        decodes, prefills = [], []
        for r in self.running:  # decodes first, each group oldest first
            left = r.num_tokens_to_compute
            if left:  # 0: its in-flight token is its last
                (prefills if left > 1 else decodes).append(r)
        decodes.sort(key=_arrival)
        prefills.sort(key=_arrival)
        order = decodes + prefills
        done: set[str] = set()
        for req in order:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens_to_compute, budget)
            while self.kv.allocate_slots(req, n) is None:
                victim = max((r for r in self.running if r.request_id not in done),
                             key=lambda r: r.arrival)
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            done.add(req.request_id)
            if req.adapter_id:
                self.slots.touch(req.adapter_id)
            out.scheduled.append(self._take(req, n))
            budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        deferred: list[Request] = []
        drain_from = self.drain_threshold()
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            if (req.grammar is not None and not req.grammar.ready
                    or not self._adapter_fits(req, drain_from)):
                deferred.append(self.waiting.popleft())
                continue
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit_tokens, budget)
            if self.kv.allocate_slots(req, n, hits) is None:
                break
            self.waiting.popleft()
            self._admit(req, num_hit_tokens, out)
            out.scheduled.append(self._take(req, n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))

    def _adapter_fits(self, req: Request, drain_from: int | None) -> bool:
        aid = req.adapter_id
        if aid == 0:
            return True
        if (drain_from is not None and aid not in self.slots.pins
                and self._since[req.request_id] > drain_from):
            return False  # paused: let the running set drain for a starving adapter
        if aid in self._adapters:
            return True
        return (len(self._adapters) < self.cfg.max_loras
                and self.slots.ready_slot(aid) is not None)

    def _count_slotless(self) -> None:
        """A step counts toward a waiting request's starvation unless its adapter has a
        slot or is being read from disk: a drain frees a slot, it cannot hasten a read.
        (A read that has not started does count: a starving adapter is the head, whose
        read always starts, engine/adapters/residency.py R1.)"""
        for req in self.waiting:
            aid = req.adapter_id
            if aid and self.slots.ready_slot(aid) is None and not self.reading(aid):
                self._slotless[req.request_id] += 1

    def drain_threshold(self) -> int | None:
        """t*: the step the oldest starving request started waiting, or None."""
        oldest = None
        for req in self.waiting:
            since = self._since[req.request_id]
            if (req.adapter_id and self._slotless[req.request_id] >= self.cfg.starvation_steps
                    and self.slots.ready_slot(req.adapter_id) is None):
                oldest = since if oldest is None else min(oldest, since)
        return oldest

    def wanted_adapters(self) -> list[int]:
        """Adapters of waiting requests in the order the residency manager brings them
        into slots (see "Batch composition" in the module docstring): while a request
        starves, the one whose oldest request waited longest first (ties: queue order);
        otherwise the one with the most waiting requests first (ties: that age order)."""
        first: dict[int, tuple[int, int]] = {}
        count: Counter = Counter()
        for pos, req in enumerate(self.waiting):
            aid = req.adapter_id
            if aid:
                key = (self._since[req.request_id], pos)
                first[aid] = min(first[aid], key) if aid in first else key
                count[aid] += 1
        by_age = sorted(first, key=first.__getitem__)
        if self.drain_threshold() is not None:
            return by_age
        return sorted(by_age, key=lambda aid: -count[aid])  # stable: ties stay by age

    def _admit(self, req: Request, num_hit_tokens: int, out: SchedulerOutput) -> None:
        # a preempted request's in-flight token is appended before the next schedule
        assert not req.num_inflight_tokens, "admitted with a token in flight"
        if req.adapter_id:
            assert self.slots.ready_slot(req.adapter_id) is not None, "checked by _adapter_fits"
            self.slots.touch(req.adapter_id)
            self._adapters[req.adapter_id] += 1
        out.cache_hits.append((req, num_hit_tokens))
        if req.status is RequestStatus.PREEMPTED:
            req.num_resumed_cached_tokens += num_hit_tokens
        else:
            req.num_cached_tokens = num_hit_tokens
        req.num_computed_tokens = num_hit_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _take(self, req: Request, n: int) -> ScheduledRequest:
        """The entry of `req` running `n` tokens this step; advances the request past them."""
        slot = self.slots.ready_slot(req.adapter_id) if req.adapter_id else None
        start = req.num_computed_tokens
        samples = start + n == req.num_tokens + req.num_inflight_tokens
        # called right after the request's allocation: its block table is final for
        # this step (requests already scheduled are never preempted)
        entry = ScheduledRequest(req, start, n, self.kv.block_id_tuple(req.request_id),
                                 -1 if slot is None else slot, samples=samples)
        req.num_computed_tokens = start + n
        req.num_inflight_steps += 1
        req.num_inflight_tokens += samples
        return entry

    def _preempt(self, req: Request) -> None:
        self._remove_running(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _remove_running(self, req: Request) -> None:
        self.running.remove(req)
        self._drop_adapter(req)

    def _drop_adapter(self, req: Request) -> None:
        if req.adapter_id:
            self._adapters[req.adapter_id] -= 1
            if not self._adapters[req.adapter_id]:
                del self._adapters[req.adapter_id]

    # ---- after the forward pass -------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, Sampled]) -> list[Request]:
        """Append the sampled tokens of a launched step and release draining requests
        this step was the last to hold. Returns the requests that got a token, in batch
        order; whether one stops with it is the output processor's decision (the engine
        then calls `finish`)."""
        self.num_updates += 1
        touched = []
        for s in out.scheduled:
            req = s.request
            req.num_inflight_steps -= 1
            req.num_inflight_tokens -= s.samples
            if req.status is RequestStatus.FINISHED:  # finished after this step's launch
                if not req.num_inflight_steps:
                    self._release(*self._draining.pop(req.request_id))
                continue  # its token, if any, is discarded
            if s.samples:
                req.append_token(sampled[req.request_id].token_id)
                touched.append(req)
        return touched
