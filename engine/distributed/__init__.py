"""Tensor parallelism across processes: rank 0 (the Engine's process) drives ranks 1..N-1.

    executor.py  rank 0: spawns the workers, sends step plans, detects dead ranks
    worker.py    ranks >= 1: process entry and message loop around an unchanged ModelRunner
    plan.py      the step-plan wire format (int64 tensors, only what changed)
    tracker.py   rank 0's view of the workers' request mirror; mirror.py the mirror itself
    adapters.py  adapter host copies and slot loads mirrored on every rank
    group.py     process groups through a TCP store on an ephemeral loopback port
"""
from engine.distributed.errors import EngineDeadError

__all__ = ["EngineDeadError"]
