"""Reusable host memory for adapter host copies: one buffer per adapter, page-locked on CUDA.

Pinning memory is slow (the driver locks every page: tens of milliseconds for an 84 MB
adapter), so buffers are never given back to the system while the engine runs: a buffer
whose host copy was dropped is kept in a free list of its exact size and handed to the
next adapter of that size (adapters of one shape, the common case, all share one size).
Sizes are exact (rounded up to 64 KiB), not powers of two: thousands of host copies must
not waste a third of host memory.

A buffer goes back to its free list when the `LoRAWeights` that owns it is garbage
collected, and only once every device copy that reads it has completed: the slot pool
records an event for each copy it queues from a buffer (`HostBuffer.fence`). Holders of
a host copy (the host cache, a copy in flight, a worker's shard cache) keep the
`LoRAWeights` alive, so no buffer is reused while anything may still read it. The
collector may find the owner inside a CUDA-graph capture, where querying those events
would break the capture: its finalizer only queues the buffer (engine/releases.py), and
`collect` (at the start of a step, before a buffer is handed out) takes it back. A
buffer's page-locking is undone the same way, after the buffer itself is gone.

On CUDA a buffer is ordinary host memory registered with the driver (cudaHostRegister)
on a background thread, after it is handed out: registration is slow (on a GPU host with
an IOMMU, ~150 ms for 84 MB) and the driver serializes it, so loads that waited for it
ran one at a time whatever the number of reader threads. Until its registration lands, a
buffer is pageable (`pinned` is False) and slot loads copy from it synchronously; where
registration fails it stays so.

With `spares`, the pool keeps that many free buffers of the size last asked for, made on
a background thread (allocated, pages touched, registered): a new adapter of a shape
already seen then gets a ready buffer instead of waiting for the driver to pin one, the
slowest part of adding it.

With `shared`, buffers are cut from anonymous shared memory (engine/lora/shared_memory.py)
so an adapter loader process can write a host copy straight into one
(engine/adapters/loader_pool.py); `HostBuffer.shared` says where it lies.

With a host reserve (engine/lora/host_reserve.py), buffers of the largest host copy's
size class are made ahead at start: `acquire` takes one for any request of that size or
smaller when no free buffer of the exact size is, ready (page-locked) ones first, then
ones whose pages are in but not yet locked.

`scratch` holds the buffers adapter files are read into before conversion, never pinned:
reusing them spares the page faults of fresh memory on every read (most of a read's
time), and the bytes are only needed until the host copy is built.
"""
from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from loramux_engine.lora.page_populate import populate
from loramux_engine.releases import ReleaseQueue
from loramux_engine.lora.shared_memory import SegmentCutter, SharedPlace

_GRANULE = 1 << 16
_ALIGN = 4096


class HostBuffer:
    """One buffer: `data` is a uint8 tensor of `nbytes` (page-aligned). `releases`: where
    its unregistration goes once it is garbage (needed only to `register` it)."""

    def __init__(self, data: torch.Tensor, nbytes: int, registered_ptr: int | None,
                 shared: SharedPlace | None = None, releases: ReleaseQueue | None = None):
        self.data = data
        self._releases = releases
        self.nbytes = nbytes
        self.shared = shared  # where it lies in shared memory, if it does
        self._registered_ptr = registered_ptr
        self._fences: list = []
        self._lock = threading.Lock()
        self._pin_lock = threading.Lock()  # one registration, whichever thread asks first
        self._pin_tried = registered_ptr is not None
        self.reserved = False  # made by a host reserve and not yet handed out

    @property
    def pinned(self) -> bool:
        """Page-locked: registered with the driver, or from torch's pinned allocator.
        (torch's `is_pinned()` knows only its own allocator's memory, not registered
        memory, so copies must not decide on it.)"""
        return self._registered_ptr is not None or self.data.is_pinned()

    def register(self) -> bool:
        """Page-lock the buffer in place (cudaHostRegister); True when it is now pinned.
        Copies that read `pinned` afterwards may be asynchronous. Its pages are faulted in
        first (populate), outside the driver. Tried once: later calls (another thread's)
        wait for that one and return its outcome."""
        with self._pin_lock:
            if not self._pin_tried:
                self._pin_tried = True
                self._register()
        return self.pinned

    def _register(self) -> None:
        assert self._releases is not None, "a registered buffer needs a release queue"
        if self._registered_ptr is None:
            ptr = self.data.data_ptr()
            populate(self.data, self.nbytes)
            try:
                ok = int(torch.cuda.cudart().cudaHostRegister(ptr, self.nbytes, 0)) == 0
            except Exception:  # no CUDA, or no such binding in this torch build
                ok = False
            if ok:
                self._registered_ptr = ptr
                # not __del__: the collector may find the buffer inside a graph capture;
                # the queued call keeps the memory alive until it is unregistered
                weakref.finalize(self, self._releases.put, _unregister, ptr, self.data)

    @property
    def pin_tried(self) -> bool:
        """Registration was attempted (it may have failed: then it stays pageable)."""
        return self._pin_tried

    def fence(self, event) -> None:
        """A device copy reading this buffer was queued; `event` completes after it."""
        with self._lock:
            self._fences.append(event)

    def idle(self) -> bool:
        """No queued device copy still reads the buffer."""
        with self._lock:
            self._fences = [e for e in self._fences if not e.query()]
            return not self._fences


class HostBufferPool:
    """Free lists of host buffers by size; thread-safe (disk reads run on several threads)."""

    def __init__(self, pin: bool = False, spares: int = 0, shared: bool = False):
        self.pin = pin
        self.spares = spares
        self._cutter = SegmentCutter() if shared else None
        self._making: dict[int, Future] = {}  # size -> spare being made
        self._maker: ThreadPoolExecutor | None = None
        self.num_spares_made = 0
        self._pinner: ThreadPoolExecutor | None = None
        self._registering: list[Future] = []
        self._free: dict[int, list[HostBuffer]] = {}
        self._unpinned: list[HostBuffer] = []  # reserve buffers populated, not page-locked
        self.reserve_size = 0      # size class of a host reserve's buffers (0: none)
        self.reserving = False     # the reserve still makes buffers
        self.num_reserve_taken = 0  # reserve buffers handed out for the first time
        self.num_unpinned_taken = 0  # of them, before the reserve page-locked them
        self._fenced: list[HostBuffer] = []   # released, a device copy may still read it
        self.releases = ReleaseQueue()   # what finalizers found, taken back by `collect`
        self._lock = threading.Lock()
        self.allocated_bytes = 0
        self.num_allocations = 0
        self.num_reuses = 0
        self._scratch: HostBufferPool | None = None

    @property
    def scratch(self) -> "HostBufferPool":
        """The pool of unpinned buffers files are read into (its own counters)."""
        with self._lock:
            if self._scratch is None:
                self._scratch = HostBufferPool(pin=False)
            return self._scratch

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(_GRANULE, -(-nbytes // _GRANULE) * _GRANULE)

    def acquire(self, nbytes: int, reserve: bool = True) -> HostBuffer:
        """A buffer of at least `nbytes` (contents undefined). `reserve`: an adapter's host
        copy, which may take a larger buffer of the host reserve; False for a buffer
        beside it (its end or expert factors: a few MB, which must not hold a full
        copy's buffer)."""
        size = self.size_class(nbytes)
        self.collect()
        with self._lock:
            buf = self._take(size, reserve)
            if buf is None:
                self.num_allocations += 1
                self.allocated_bytes += size
            self._make_spares(size)
        return buf if buf is not None else self._allocate(size)

    def _take(self, size: int, reserve: bool) -> HostBuffer | None:
        """A free buffer for a request of `size`: of that size, else, for a host copy
        (`reserve`), a reserve buffer (under the lock). A reserve buffer is larger than a
        smaller adapter needs; the host tier counts adapters, and max_cpu_loras was sized
        for full copies."""
        free = self._free.get(size)
        fits = reserve and self.reserve_size >= size
        if not free and fits:
            free = self._free.get(self.reserve_size)
        if free:
            self.num_reuses += 1
            buf = free.pop()
        elif fits and self._unpinned:
            buf = self._unpinned.pop()   # its pages are in: only the lock is left to take
            self.num_unpinned_taken += 1
            self._pin_later(buf)
        else:
            return None
        if buf.reserved:
            buf.reserved = False
            self.num_reserve_taken += 1
        return buf

    # ---- what a host reserve (engine/lora/host_reserve.py) asks of the pool ----------
    def allocate_reserved(self, size: int, budget_bytes: int) -> HostBuffer | None:
        """A new buffer of `size` for the reserve, or None once the pool's buffers (every
        size, every maker) would exceed `budget_bytes` with it. Not page-locked."""
        with self._lock:
            if self.allocated_bytes + size > budget_bytes:
                return None
            self.allocated_bytes += size
        buf = self._new_buffer(size)
        buf.reserved = True
        return buf

    def offer_reserved(self, buf: HostBuffer) -> None:
        """A reserve buffer is populated: free now, or first to be page-locked (self.pin
        and not tried yet)."""
        with self._lock:
            if self.pin and not buf.pin_tried:
                self._unpinned.append(buf)
            else:
                self._free.setdefault(buf.nbytes, []).append(buf)

    def take_unpinned(self) -> HostBuffer | None:
        """A reserve buffer still to be page-locked (the reserve's pin thread), if any."""
        with self._lock:
            return self._unpinned.pop() if self._unpinned else None

    def _make_spares(self, size: int) -> None:
        """Start making a spare of `size` unless `spares` are free or one is being made
        (under the lock)."""
        if len(self._free.get(size, ())) >= self.spares or size in self._making:
            return
        if size <= self.reserve_size and (self.reserving or self._unpinned
                                          or self._free.get(self.reserve_size)):
            return   # the reserve has one, or is making it
        if self._maker is None:
            self._maker = ThreadPoolExecutor(1, thread_name_prefix="host-buffers")
        self._making[size] = self._maker.submit(self._make_spare, size)

    def _make_spare(self, size: int) -> None:
        try:
            buf = self._allocate(size)
            if not buf.pinned and buf.shared is None:
                # fault the pages in now, not during a read (a loader process writing a
                # shared buffer faults them itself: no work of this process)
                buf.data.zero_()
        except BaseException:
            with self._lock:  # out of memory: no spare; acquire allocates as before
                del self._making[size]
            raise
        with self._lock:
            self._free.setdefault(size, []).append(buf)
            self.allocated_bytes += size
            self.num_spares_made += 1
            del self._making[size]
            self._make_spares(size)

    def wait_spares(self) -> None:
        """Block until the spares being made are free (tests, benchmarks)."""
        while True:
            with self._lock:
                making = list(self._making.values())
            if not making:
                return
            wait(making)

    def attach(self, owner, buf: HostBuffer) -> None:
        """Return `buf` to the pool when `owner` is garbage collected: queued, taken back
        by the next `collect` (module docstring)."""
        weakref.finalize(owner, self.releases.put, self.release, buf)

    def release(self, buf: HostBuffer) -> None:
        """Take `buf` back now (its holder's thread, never a finalizer: this queries the
        buffer's fences)."""
        with self._lock:
            if buf.idle():
                self._free.setdefault(buf.nbytes, []).append(buf)
            else:
                self._fenced.append(buf)

    def collect(self) -> None:
        """Take back what finalizers queued and the fenced buffers whose copies are done.
        Any thread, at a point where it is not capturing a CUDA graph (the start of a step,
        `acquire`); inside a capture nothing is done."""
        self.releases.run()
        with self._lock:
            self._reap()

    def close(self) -> None:
        """Drop the free buffers and undo their page-locking (the engine's close); buffers
        still held come back, and are unregistered, as soon as their holder drops them
        (no step will come to collect them)."""
        with self._lock:
            self._free.clear()
            self._fenced.clear()
            self._unpinned.clear()
        self.releases.close()

    def _reap(self) -> None:
        still = []
        for buf in self._fenced:
            if buf.idle():
                self._free.setdefault(buf.nbytes, []).append(buf)
            else:
                still.append(buf)
        self._fenced = still

    @property
    def num_free(self) -> int:
        self.collect()
        with self._lock:
            return sum(len(v) for v in self._free.values())

    @property
    def shared(self) -> bool:
        return self._cutter is not None

    def _allocate(self, size: int) -> HostBuffer:
        buf = self._new_buffer(size)
        if self.pin:  # registered later, off the caller's path (module docstring)
            with self._lock:
                self._pin_later(buf)
        return buf

    def _new_buffer(self, size: int) -> HostBuffer:
        if self._cutter is not None:
            data, place = self._cutter.cut(size)
            return HostBuffer(data, size, None, shared=place, releases=self.releases)
        return HostBuffer(_aligned(size), size, None, releases=self.releases)

    def _pin_later(self, buf: HostBuffer) -> None:
        """Register `buf` on the pin thread (under the lock)."""
        if self._pinner is None:
            self._pinner = ThreadPoolExecutor(1, thread_name_prefix="host-pin")
        self._registering = [f for f in self._registering if not f.done()]
        self._registering.append(self._pinner.submit(buf.register))

    def wait_registered(self) -> None:
        """Block until every buffer handed out so far went through registration."""
        with self._lock:
            pending, self._registering = self._registering, []
        wait(pending)


def shared_memory_pins() -> bool:
    """Whether this machine's driver page-locks shared memory (cudaHostRegister of an
    anonymous shared mapping). Loader processes write into such buffers; where they could
    not be page-locked, every slot load would copy synchronously, so the engine reads in
    its own process instead (engine/assembly.py)."""
    data, place, releases = *SegmentCutter().cut(1 << 20), ReleaseQueue()
    pins = HostBuffer(data, 1 << 20, None, shared=place, releases=releases).register()
    releases.run()   # the probe's buffer is garbage by now: undo its page-locking
    return pins


def _unregister(ptr: int, data: torch.Tensor) -> None:
    """Undo a buffer's page-locking; `data` (its memory) is freed after this."""
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _aligned(size: int) -> torch.Tensor:
    raw = torch.empty(size + _ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % _ALIGN
    return raw[skip:skip + size]
