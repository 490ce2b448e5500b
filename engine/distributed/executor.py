"""Rank 0's executor for a tensor-parallel engine: spawns ranks 1..N-1, sends each step's
plan, runs rank 0's shard, and turns any rank's death into EngineDeadError.

Sampling: every rank computes the step's logits (the vocabulary-parallel head all-gathers
them inside the model), but only rank 0 samples; the sampled tokens reach the workers as
"new tokens" in the next plan. Rank 0 owns every sampler state (seeds, penalties), so
nothing else has to stay in sync.

Async scheduling (`launch`): every step leaves its tokens on every rank's device too: a
step whose sampling rows all take the greedy pick, because every rank picks the same
(ModelRunner.takes_greedy_pick), any other by a broadcast of rank 0's sampled tokens
(ModelRunner._sample). So rank 0 may launch the next step before reading them: the next
plan then carries, per request, one input token fewer than it runs, and each worker
fills that placeholder from its own previous step's tokens at the same row, as rank 0
does (engine/runner.py). After a step whose sampler reads the token history (repetition
penalty) rank 0 reads the tokens first and sends them in the plan (engine/engine.py).
"""
from __future__ import annotations

import dataclasses
import json
import time
import weakref

import torch
import torch.multiprocessing as mp

from loramux_engine.config import EngineConfig
from loramux_engine.distributed import fast_allreduce
from loramux_engine.distributed import group as pg
from loramux_engine.distributed.adapters import AdapterMirror
from loramux_engine.distributed.channel import PlanChannel
from loramux_engine.distributed.plan import (OP_ADD_ADAPTER, OP_SHUTDOWN, OP_STEP, OP_WARMUP,
                                     encode_add_adapter, encode_step, encode_text)
from loramux_engine.distributed.tracker import PlanTracker
from loramux_engine.distributed.watchdog import WorkerWatchdog
from loramux_engine.distributed.worker import worker_main
from loramux_engine.executor import Executor, LocalExecutor
from loramux_core.errors import EngineDeadError

START_TIMEOUT_S = 120.0


def make_executor(config: EngineConfig) -> Executor:
    """TPExecutor at tp_size > 1 (this process becomes rank 0 and spawns the others), else
    LocalExecutor. Creating a TPExecutor, not importing this module, spawns processes."""
    if config.tp_size > 1:
        return TPExecutor(config)
    return LocalExecutor()


class TPExecutor:
    """The Executor (engine/executor.py) of a tensor-parallel group, in rank 0's process.
    `tp` is rank 0's TPGroup; build rank 0's shard with it, then `launch` each step and
    read its `result`."""

    def __init__(self, config):
        self.size = config.tp_size
        self.device = torch.device(config.device)
        self._ops: list[tuple[int, int, int]] = []   # (kind, slot, adapter id)
        self._adds: list[tuple[int, str, str]] = []   # (adapter id, path, version)
        self._tracker = PlanTracker()
        self._closed = False
        self._failed = False   # a collective raised (the watchdog may not see a death yet)
        pg.check_free(self.device)
        store = pg.open_store()
        spec = {"config": dataclasses.asdict(config), "size": self.size, "port": store.port}
        ctx = mp.get_context("spawn")
        self._procs = [ctx.Process(target=worker_main, args=(json.dumps({**spec, "rank": r}),),
                                   name=f"loramux-tp{r}", daemon=True)
                       for r in range(1, self.size)]
        for p in self._procs:
            p.start()
        self._watchdog = WorkerWatchdog(self._procs)
        self._finalizer = weakref.finalize(self, _stop_procs, self._procs, self._watchdog)
        self._wait_ready(store)
        groups = self._guard(lambda: pg.connect(store, 0, self.size, self.device))
        self._store = store
        try:  # the all-reduce every rank agrees on (one-shot or the group's)
            self.tp = fast_allreduce.attach(groups.tp, groups.control, config, self.device)
        except BaseException:
            self.close()
            raise
        self._control = groups.control
        self._channel = PlanChannel(groups.control, 0)

    def _wait_ready(self, store) -> None:
        """Workers announce themselves before joining the groups; one that dies on the
        way fails the start at once instead of leaving rank 0 in a rendezvous."""
        keys = [f"ready/{r}" for r in range(1, self.size)]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not store.check(keys):
            why = self._watchdog.poll()
            if why is not None or time.monotonic() > deadline:
                self.close()
                raise EngineDeadError(why or f"tensor-parallel workers not up after "
                                      f"{START_TIMEOUT_S:.0f} s")
            time.sleep(0.02)

    # ---- collectives with rank 0's view of the workers ---------------------------
    def agree_min(self, value: int) -> int:
        return self._guard(lambda: pg.agree_min(self._control, value))

    def queue_add(self, adapter_id: int, path: str, version: str) -> None:
        """Where a version's files are and what they hash to, for the workers, before its
        first slot load."""
        self._adds.append((adapter_id, path, version))

    def queue_op(self, kind: int, slot: int, adapter_id: int) -> None:
        """A slot or host-copy change for the workers' next step plan."""
        self._ops.append((kind, slot, adapter_id))

    def launch(self, out, runner, prev, masks=None):
        """Send this step's plan and queue rank 0's shard without waiting for its tokens
        (async scheduling); `prev`: rank 0's step in flight, whose tokens this step's
        placeholders take (on every rank: only after a `tokens_on_every_rank` step);
        `masks`: the constrained rows' bitmask source, rank 0's alone (only it samples)."""
        assert prev is None or prev.tokens_on_every_rank, "placeholders the workers lack"
        return self._guard(lambda: self._launch(out, runner, prev, masks))

    def result(self, pending):
        """Rank 0's tokens of a launched step (a failed collective: EngineDeadError)."""
        return self._guard(pending.result)

    def must_read_before_next(self, pending) -> bool:
        """The next step needs this one's tokens on the host first: a sampler reads them,
        or some rank lacks them on its device (they reach it in the next plan)."""
        return pending.needs_history or not pending.tokens_on_every_rank

    def adapter_mirror(self, registry) -> AdapterMirror:
        """Rank 0's residency observer: queues every slot load and host drop for the
        workers' next step plan."""
        return AdapterMirror(self, registry)

    def warm_up(self, runner, plan, progress=None, on_shape=None):
        """The start-up warm-up on every rank: the workers are sent `plan` and run it as
        rank 0 does (the same eager steps and graph captures in the same order: their
        collectives pair up), then every rank says how many eager steps it ran. Any
        failure, here or on a worker, is EngineDeadError: a rank that stopped part-way
        would leave the others waiting in a collective."""
        def run():
            self._channel.send(OP_WARMUP, encode_text(plan.to_json()))
            report = plan.run(runner, progress, on_shape)
            if pg.agree_min(self._control, report.eager_steps) != report.eager_steps:
                raise RuntimeError("a worker ran fewer warm-up steps than rank 0")
            return report
        try:
            return self._guard(run)
        except EngineDeadError:
            raise
        except BaseException as exc:   # the workers may be inside a collective
            self._failed = True
            _stop_procs(self._procs, self._watchdog)
            if not isinstance(exc, Exception):
                raise   # an interrupt stays one
            raise EngineDeadError(f"the warm-up failed on rank 0: {exc!r}") from exc

    def _launch(self, out, runner, prev, masks):
        adds, self._adds = self._adds, []
        ops, self._ops = self._ops, []
        # rank 0 decides the greedy pick (only it samples); the plan carries the decision so
        # that every rank replays the same CUDA graph or picks eagerly the same way
        greedy = runner.takes_greedy_pick(out.scheduled, tensor_parallel=True)
        plan = self._tracker.plan(out, ops, greedy)
        for add in adds:
            self._channel.send(OP_ADD_ADAPTER, encode_add_adapter(*add))
        self._channel.send(OP_STEP, encode_step(plan))
        if ops:  # workers may read adapter shards from disk first: wait for them on
            pg.agree_min(self._control, 0)  # the control group, not in a timed collective
        return runner.launch(out, prev, greedy, masks)

    def _guard(self, fn):
        why = self._watchdog.poll() if not self._closed else "the engine is closed"
        if why is not None:
            raise EngineDeadError(why)
        try:
            return fn()
        except RuntimeError as exc:  # a collective failed: find out which rank is gone
            deadline = time.monotonic() + 2.0
            while self._watchdog.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            why = self._watchdog.poll() or f"a collective failed: {exc}"
            self._failed = True
            _stop_procs(self._procs, self._watchdog)
            raise EngineDeadError(why) from exc

    # ---- shutdown -----------------------------------------------------------------
    def close(self, timeout_s: float = 10.0) -> None:
        """Tell the workers to stop and join them (killing any that do not stop)."""
        if self._closed:
            return
        self._closed = True
        self._watchdog.stop()
        if self._watchdog.dead is None and hasattr(self, "_channel"):
            try:
                self._channel.send(OP_SHUTDOWN)
            except RuntimeError:
                pass  # a worker is gone already; the join below cleans up
        # The workers leave the model group as soon as they read the shutdown; rank 0
        # leaves it now too, not after the join (see pg.disconnect).
        pg.disconnect(self.device)
        deadline = time.monotonic() + timeout_s
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()

    @property
    def dead(self) -> bool:
        """A worker died or a collective failed: rank 0's queued NCCL kernels may wait for
        the lost peer until the communicator is aborted (close() aborts it)."""
        return self._failed or self._watchdog.poll() is not None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]


def _stop_procs(procs, watchdog) -> None:
    watchdog.stop()
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)
