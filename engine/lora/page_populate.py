"""Faulting in the pages of host memory ahead of its use, without writing it: one
madvise(MADV_POPULATE_WRITE) call (Linux 5.14 and later), which runs without the
interpreter lock. Host buffers are populated before they are page-locked
(engine/lora/host_buffers.py) and a host reserve's buffers as they are made
(engine/lora/host_reserve.py)."""
from __future__ import annotations

import ctypes

import torch

_MADV_POPULATE_WRITE = 23   # Linux 5.14 and later
_PAGE = 4096


def populate(data: torch.Tensor, nbytes: int) -> bool:
    """Fault in the pages of the first `nbytes` of `data` (the kernel allocates them), so
    that page-locking them does not. cudaHostRegister faults in missing pages itself,
    inside the driver, under a lock every kernel launch and copy of the process also
    takes: on an H200, fresh 21 MB shared buffers registered while decoding stretched the
    steps from 1.2 ms to 175 ms; populated first, the steps took 1.9 ms and each
    registration under 1 ms (benchmarks/results/2026-11-27-h200-loads/NOTES.md). One
    madvise(MADV_POPULATE_WRITE), which
    leaves the bytes as they are (a reader may be writing the buffer already) and runs
    without the interpreter lock; False where the kernel has none (before Linux 5.14),
    and the driver faults the pages in as before."""
    if _madvise is None:
        return False
    ptr = data.data_ptr()
    base = ptr - ptr % _PAGE
    return _madvise(base, nbytes + ptr - base, _MADV_POPULATE_WRITE) == 0


def _libc_madvise():
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()
