"""Two tensor-parallel ranks as two threads of the test process, over real gloo groups
(engine/distributed/group.py) met through a loopback TCP store."""
from __future__ import annotations

import threading

import torch

from engine.distributed import group as pg


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
