"""Tensor-parallel test helpers: two ranks as two threads of the test process over real
gloo groups (engine/distributed/group.py) met through a loopback TCP store, and the check
that a killed worker rank takes its engine down promptly."""
from __future__ import annotations

import threading

import torch

from loramux_engine.distributed import group as pg


def two_ranks(fn, timeout_s: float = 60.0) -> dict:
    """fn(rank, groups) on ranks 0 and 1 at once; their results by rank. An exception in
    either rank fails the caller."""
    store = pg.open_store()
    out, errors = {}, []

    def run(rank):
        try:
            s = store if rank == 0 else pg.join_store(store.port)
            out[rank] = fn(rank, pg.connect(s, rank, 2, torch.device("cpu")))
        except Exception as exc:  # surfaced below
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not errors, errors
    return out


def kill_rank_and_expect_dead(engine, pid: int, within_s: float = 30.0) -> None:
    """SIGKILL a worker rank of `engine`; stepping must raise EngineDeadError naming
    rank 1 within `within_s` (no hang: well inside the model group's 60 s timeout,
    engine/distributed/group.py, and far above a loaded machine's stalls), and the
    engine must stay dead."""
    import os
    import signal
    import time

    import pytest

    from loramux_core.errors import EngineDeadError

    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1"):
        while engine.has_unfinished():
            engine.step()
    assert time.monotonic() - start < within_s
    with pytest.raises(EngineDeadError):  # and it stays dead
        engine.step()
