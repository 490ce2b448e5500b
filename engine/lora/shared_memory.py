"""Host buffers another process can write: anonymous shared memory, handed over by fd.

Adapter loader processes (engine/adapters/loader_pool.py) write an adapter's host copy
straight into the engine's host buffer. A buffer is a slice of a *segment*: one memfd
(anonymous, never named in /dev/shm: nothing to collide with another engine, nothing left
behind by a crash) mapped once in the engine. Buffers of one size are cut from segments
of up to SEGMENT_BUFFERS buffers, so thousands of host copies hold a few dozen file
descriptors, not thousands. A segment's pages are allocated only when written, and its
fd and mapping go when the last buffer cut from it is garbage collected.

    segment (memfd, size class S):  | buf 0 | buf 1 | buf 2 | ... (reserved, not touched)
    SharedPlace(segment, offset):    where a buffer lies: what a loader process maps

A loader maps (fd, offset, nbytes) for the one load it writes, and unmaps it after.
"""
from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass

import torch

SEGMENT_BUFFERS = 64
SEGMENT_MAX_BYTES = 1 << 36   # address space reserved per segment (never touched: free)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class Segment:
    """One memfd mapped whole in this process; `fd` is what loaders map. Its two
    descriptors (ours, and the mapping's own duplicate: CPython's mmap keeps one) go when
    the segment and the last view of `data` are gone."""

    def __init__(self, nbytes: int):
        self.fd = os.memfd_create("loramux-host", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            self._map = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.nbytes = nbytes
        # views keep the mapping alive (torch holds a reference to the mmap object)
        self.data = torch.frombuffer(self._map, dtype=torch.uint8)

    def __del__(self):
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            os.close(fd)


@dataclass(frozen=True)
class SharedPlace:
    """Where a buffer lies in shared memory: its segment (kept alive by the buffer) and
    the byte offset in it."""
    segment: Segment
    offset: int

    @property
    def fd(self) -> int:
        return self.segment.fd


class SegmentCutter:
    """Cuts buffers of one size class after the other from segments (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[int, tuple[Segment, int]] = {}  # size -> (segment, next index)

    def cut(self, size: int) -> tuple[torch.Tensor, SharedPlace]:
        """A fresh `size`-byte view of shared memory and its place."""
        with self._lock:
            seg, index = self._open.get(size, (None, 0))
            per_segment = max(1, min(SEGMENT_BUFFERS, SEGMENT_MAX_BYTES // size))
            if seg is None or index >= per_segment:
                seg, index = Segment(size * per_segment), 0
            self._open[size] = (seg, index + 1)
        offset = index * size
        return seg.data[offset:offset + size], SharedPlace(seg, offset)


def map_place(fd: int, offset: int, nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A loader's writable view of a buffer handed over as (fd, offset, nbytes): the
    mapping (close it after the last view is gone) and a uint8 tensor over it."""
    page = mmap.ALLOCATIONGRANULARITY
    start = offset - offset % page
    # populated at once: one call instead of a page fault per page the load writes
    m = mmap.mmap(fd, nbytes + offset - start, mmap.MAP_SHARED | _POPULATE,
                  mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    return m, torch.frombuffer(m, dtype=torch.uint8)[offset - start:]
