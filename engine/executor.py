"""Where a step's forward pass runs: this process alone, or a tensor-parallel group.

The engine's step path is the same for both: it launches each scheduled step through its
`Executor` and reads the step's tokens back through it. `LocalExecutor` runs the step on
this process's device; `TPExecutor` (engine/distributed/executor.py) also sends the step's
plan to ranks 1..N-1 and mirrors adapter slot changes to them, and turns a dead rank
into EngineDeadError. `make_executor` (beside TPExecutor) picks one of the two: this
module sits below the distributed one, whose worker builds its model with
engine/assembly.py, which names `Executor`.
"""
from __future__ import annotations

from typing import Protocol

from loramux_engine.parallel import TPGroup
from loramux_engine.pending import PendingSample
from loramux_engine.runner import MaskSource, ModelRunner
from loramux_engine.scheduler import Sampled, SchedulerOutput


class Executor(Protocol):
    """Runs the steps of one engine replica on all of its ranks.

    `tp`: this process's TPGroup (build its shard with it). `agree_min(n)`: the smallest
    of every rank's `n` (each rank's KV cache then holds the same blocks). `launch` queues
    a step on every rank without waiting for its tokens; `prev` is the launched step whose
    tokens this step's placeholder inputs take, and may be given only when
    `must_read_before_next(prev)` is False; `masks`: rank 0's source of the constrained
    rows' token bitmask (engine/runner.py). `result` waits for a launched step's tokens.
    `adapter_mirror(registry)`: the residency observer that repeats slot loads and host
    drops on the other ranks, or None. `warm_up(runner, plan, progress, on_shape)`: run
    the start-up warm-up rank 0 resolved (engine/warmup.py WarmupPlan) on every rank,
    before any step. `close` stops the other ranks. `dead`: a rank is gone or a
    collective failed, so work queued on this device may wait forever for a peer
    (close() must not wait for the device then)."""

    tp: TPGroup
    dead: bool

    def agree_min(self, value: int) -> int: ...

    def launch(self, out: SchedulerOutput, runner: ModelRunner, prev: PendingSample | None,
               masks: MaskSource | None = None) -> PendingSample: ...

    def result(self, pending: PendingSample) -> dict[str, Sampled]: ...

    def must_read_before_next(self, pending: PendingSample) -> bool: ...

    def adapter_mirror(self, registry): ...

    def warm_up(self, runner: ModelRunner, plan, progress=None, on_shape=None): ...

    def close(self) -> None: ...


class LocalExecutor:
    """One process, one device: the runner decides its own greedy pick."""

    tp = TPGroup.single()
    dead = False

    def agree_min(self, value: int) -> int:
        return value

    def launch(self, out: SchedulerOutput, runner: ModelRunner, prev: PendingSample | None,
               masks: MaskSource | None = None) -> PendingSample:
        return runner.launch(out, prev, masks=masks)

    def result(self, pending: PendingSample) -> dict[str, Sampled]:
        return pending.result()

    def must_read_before_next(self, pending: PendingSample) -> bool:
        """A sampler of the next step needs this step's tokens on the host."""
        return pending.needs_history

    def adapter_mirror(self, registry) -> None:
        return None

    def warm_up(self, runner: ModelRunner, plan, progress=None, on_shape=None):
        return plan.run(runner, progress, on_shape)

    def close(self) -> None:
        pass

