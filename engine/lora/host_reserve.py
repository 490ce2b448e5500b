"""Host memory made ready at start for adapters' host copies, before the loads that need it.

A host copy's buffer costs two things the first time (engine/lora/host_buffers.py): the
kernel's first touch of its pages, which on a VM goes at about 4.7 GB/s for the whole
process whatever the thread count, and on CUDA page-locking (cudaHostRegister), ~8 ms per
84 MB under the driver's lock, which every kernel launch of the step thread also takes
(benchmarks/results/2026-11-28-h200-round5/first-touch-f4b4ace.md). An engine's first
`max_cpu_loras` loads pay both, so they ran at a third of the rate of loads into reused
memory and stretched decode steps 1.5x on an H200. The reserve pays them in the
background instead:

    fill thread:  allocate (shared memory with loader processes), populate on
                  `populate_threads` threads (MADV_POPULATE_WRITE: no driver, no lock)
                  ──▶ pool: free and ready (CPU), or waiting to be page-locked (CUDA)
    pin thread:   page-locks them one at a time (CUDA): back to back while the
                  engine has no request; while it has, after each registration of d
                  seconds a pause of d * (1 / lock_share - 1), so that the driver's lock
                  is held at most `lock_share` of the time its steps run; not at all
                  while held (`hold`: the warm-up, whose compiles and graph captures
                  take the lock often, and would take longer to start the engine)

Buffers are of one size class: the host copy of an adapter that wraps every LoRA group
of the model at max_lora_rank (engine/lora/weights.py full_copy_bytes), so any adapter
fits one. The reserve makes buffers until the pool's buffers (of every size, made by
anyone) hold `count` of them in bytes: loads that allocated meanwhile shrink it, and it
never adds to what they took. It never blocks a load: one that finds no buffer ready
allocates as without a reserve, one that finds a populated buffer not yet page-locked
takes it and has it locked by the pool. `close` stops both threads promptly.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from loramux_engine.lora.host_buffers import HostBuffer, HostBufferPool
from loramux_engine.lora.page_populate import populate
from loramux_engine.resolve import meminfo

POPULATE_THREADS = 4   # populate saturated at 4 threads on an H200 VM (4.69 GB/s; 14: 4.75)
LOCK_SHARE = 0.1       # of wall time under the driver's lock while requests run
PAUSE_SLICE_S = 0.05   # how often a pause looks whether the engine became idle
NICENESS = 10          # populate threads run below the engine, as its loader processes do
# of the host's memory the reserve leaves available: engines that start together each
# size their host tier from the memory available before the others' reserves take it
MIN_AVAILABLE_SHARE = 0.2


class HostReserve:
    """Up to `count` buffers of `nbytes` (rounded to the pool's size class) made ready in
    `pool` in the background, from `start` until done or `close`; `held`: page-locking
    waits for `resume` from the start; `room`: the bytes it may still take from the host
    (None: no limit), looked at before each buffer (default: host_room)."""

    def __init__(self, pool: HostBufferPool, nbytes: int, count: int,
                 populate_threads: int = POPULATE_THREADS, lock_share: float = LOCK_SHARE,
                 held: bool = False, log: Callable[[str], None] | None = None,
                 room: Callable[[], int | None] | None = None):
        self.pool = pool
        self.size = pool.size_class(nbytes)
        self.target = count          # lowered when the budget ends the fill early
        self._allocated = 0
        self._made = 0     # populated and in the pool
        self._locked = 0   # of them, page-locked here
        self.seconds: float | None = None   # from start to complete, once complete
        self._threads_n = populate_threads
        self._pause_per_s = 1.0 / lock_share - 1.0
        self._log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self._room = room or host_room
        self._cv = threading.Condition()
        self._held = held
        self._busy: Callable[[], bool] = lambda: True
        self._filled = False
        self._short = False   # host memory ran low: said once
        self._stopped = False
        self._registering = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._t0 = 0.0
        pool.reserve_size = self.size

    # ---- control --------------------------------------------------------------------
    def start(self, busy: Callable[[], bool] = lambda: True) -> None:
        """Begin making the buffers (idempotent). `busy`: whether the engine's steps run
        now (page-locking is paced only then); any thread may call it."""
        if self._threads or self.target <= 0:
            return
        self._busy = busy
        self._t0 = time.monotonic()
        self._log(f"engine: host reserve: making {self.target} buffers of "
                  f"{self.size / 1e6:.1f} MB ({self.target * self.size / 1e9:.1f} GB) for "
                  "adapters' host copies, in the background")
        self.pool.reserving = True
        self._threads = [threading.Thread(target=self._fill, name="host-reserve-fill",
                                          daemon=True)]
        if self.pool.pin:
            self._threads.append(threading.Thread(target=self._pin, name="host-reserve-pin",
                                                  daemon=True))
        for t in self._threads:
            t.start()

    def hold(self) -> None:
        """No page-locking from now until `resume`; returns once none is under way."""
        self._set_held(True)
        with self._registering:
            pass

    def resume(self) -> None:
        """Page-lock again (paced while the engine is busy)."""
        self._set_held(False)

    def close(self) -> None:
        """Stop making buffers; returns once both threads have ended (a populate or a
        registration under way finishes first: tens of milliseconds)."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        self.pool.reserving = False

    @property
    def num_ready(self) -> int:
        """Buffers finished: populated, and on CUDA page-locked here or taken by a load
        before (the pool has those locked)."""
        if not self.pool.pin:
            return self._made
        return self._locked + self.pool.num_unpinned_taken

    @property
    def complete(self) -> bool:
        return self.seconds is not None

    def counters(self) -> dict[str, int]:
        """host_reserve_target, _ready (finished buffers), _taken (first hand-outs)."""
        return {"host_reserve_target": self.target, "host_reserve_ready": self.num_ready,
                "host_reserve_taken": self.pool.num_reserve_taken}

    def _set_held(self, held: bool) -> None:
        with self._cv:
            self._held = held
            self._cv.notify_all()

    # ---- the threads ----------------------------------------------------------------
    def _fill(self) -> None:
        """Allocate and populate, a few buffers at a time, until the budget is reached
        (or memory runs out: the reserve is then what was made, said on stderr)."""
        try:
            self._fill_to(self.target * self.size)
        except Exception as err:   # noqa: BLE001 (out of memory: loads allocate as before)
            self._log(f"engine: host reserve stopped after {self._made} buffers: {err!r}")
        with self._cv:
            self._filled = True
            if not self._stopped:   # the budget ended it: what was made is the reserve
                self.target = self._made
            self._cv.notify_all()
        self.pool.reserving = False
        if not self.pool.pin:
            self._finish()

    def _fill_to(self, budget: int) -> None:
        with ThreadPoolExecutor(self._threads_n, thread_name_prefix="host-reserve",
                                initializer=_lower_priority) as ex:
            pending: deque = deque()
            try:
                while not self._stopped:
                    while len(pending) < 2 * self._threads_n:
                        buf = self._allocate(budget)
                        if buf is None:
                            break
                        pending.append(ex.submit(_populate, buf))
                    if not pending:
                        return
                    self._offer(pending.popleft().result())
            finally:   # allocated already (stopped, or a failure): they join the pool
                for f in pending:
                    if f.exception() is None:
                        self._offer(f.result())

    def _allocate(self, budget: int) -> HostBuffer | None:
        room = self._room()
        if room is not None and room < self.size:
            if not self._short:
                self._short = True
                self._log(f"engine: host reserve: host memory available fell to its floor "
                          f"({MIN_AVAILABLE_SHARE:.0%} of the host's), after "
                          f"{self._allocated} buffers")
            return None
        buf = self.pool.allocate_reserved(self.size, budget)
        self._allocated += buf is not None
        return buf

    def _offer(self, buf: HostBuffer) -> None:
        self.pool.offer_reserved(buf)
        with self._cv:
            self._made += 1
            self._cv.notify_all()

    def _pin(self) -> None:
        """Page-lock the populated buffers one at a time, unless held; paced while the
        engine is busy."""
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopped or not self._held)
                if self._stopped:
                    return
                filled = self._filled
            buf = self.pool.take_unpinned()
            if buf is None:
                if filled:   # every buffer made is locked, or a load took it
                    self._finish()
                    return
                with self._cv:
                    self._cv.wait(0.05)   # for the fill thread's next one
                continue
            with self._registering:
                if self._held:    # held since the check above: give it back
                    self.pool.offer_reserved(buf)
                    continue
                t = time.monotonic()
                buf.register()
                took = time.monotonic() - t
            self.pool.offer_reserved(buf)
            with self._cv:
                self._locked += 1
            self._pause(took * self._pause_per_s)

    def _pause(self, seconds: float) -> None:
        """Wait `seconds` while the engine is busy: cut short when it becomes idle (looked
        at every PAUSE_SLICE_S) or the reserve is closed."""
        end = time.monotonic() + seconds
        with self._cv:
            while not self._stopped and self._busy():
                left = end - time.monotonic()
                if left <= 0:
                    return
                self._cv.wait(min(left, PAUSE_SLICE_S))

    def _finish(self) -> None:
        if self._stopped:
            return
        self.seconds = time.monotonic() - self._t0
        gb = self.num_ready * self.size / 1e9
        self._log(f"engine: host reserve complete: {self.num_ready} buffers of "
                  f"{self.size / 1e6:.1f} MB ({gb:.1f} GB) in {self.seconds:.1f} s, "
                  f"{self.pool.num_reserve_taken} taken by loads meanwhile")


def host_room() -> int | None:
    """Bytes the host can still give a reserve: what /proc/meminfo says is available less
    MIN_AVAILABLE_SHARE of its total; None where it cannot be read."""
    fields = meminfo()
    if "MemAvailable" not in fields or "MemTotal" not in fields:
        return None
    return fields["MemAvailable"] - int(fields["MemTotal"] * MIN_AVAILABLE_SHARE)


def _lower_priority() -> None:
    """This thread NICENESS steps below the process (Linux schedules threads alone): the
    kernel's page zeroing it asks for yields to the step thread and the compiles."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + NICENESS)
    except (OSError, AttributeError):   # not permitted, or no such call: as it is
        pass


def _populate(buf: HostBuffer) -> HostBuffer:
    if not populate(buf.data, buf.nbytes):   # no MADV_POPULATE_WRITE: touch each page
        buf.data[::4096].zero_()
    return buf
