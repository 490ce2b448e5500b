"""Tensor parallelism across processes: rank 0 (the Engine's process) drives ranks 1..N-1.

    executor.py  rank 0: spawns the workers, sends step plans, detects dead ranks
    worker.py    ranks >= 1: process entry and message loop around an unchanged ModelRunner
    plan.py      the step-plan wire format (int64 tensors, only what changed)
    tracker.py   rank 0's view of the workers' request mirror; mirror.py the mirror itself
    adapters.py  adapter slot loads and host copies mirrored on every rank, by adapter id
    group.py     process groups through a TCP store on an ephemeral loopback port

A rank's death surfaces as loramux_core.errors.EngineDeadError.
"""
