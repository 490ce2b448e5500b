"""Process watchdogs: a dead rank takes the whole tensor-parallel engine down, never a hang.

- Rank 0 watches its workers' process sentinels. When one exits unexpectedly it records
  why and terminates the other workers, so that any collective rank 0 is blocked in
  fails at once (gloo reports the closed connections) and rank 0 raises EngineDeadError.
- A worker watches its parent (rank 0's process) and exits as soon as it is gone, so no
  worker outlives its engine.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading


class WorkerWatchdog:
    def __init__(self, procs: list):
        self._procs = procs               # procs[i] is rank i + 1
        self._closing = threading.Event()
        self.dead: str | None = None      # why the engine is dead, once it is
        self._thread = threading.Thread(target=self._run, name="tp-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs, start=1)}
        while not self._closing.is_set():
            ready = multiprocessing.connection.wait(list(sentinels), timeout=0.2)
            if not ready or self._closing.is_set():
                continue
            rank = sentinels[ready[0]]
            proc = self._procs[rank - 1]
            proc.join(0)
            self.dead = (f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                         f"{proc.exitcode}")
            for p in self._procs:
                if p.is_alive():
                    p.terminate()
            return

    def poll(self) -> str | None:
        """Why the engine is dead (checking the sentinels now), or None."""
        if self.dead is None and not self._closing.is_set():
            for rank, p in enumerate(self._procs, start=1):
                if not p.is_alive():
                    p.join(0)
                    self.dead = (f"tensor-parallel rank {rank} (pid {p.pid}) exited with "
                                 f"code {p.exitcode}")
        return self.dead

    def stop(self) -> None:
        """Expected shutdown from here on: exits are no longer deaths."""
        self._closing.set()
        self._thread.join(1.0)


def exit_with_parent() -> None:
    """In a worker: a daemon thread that ends this process when its parent dies."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()
