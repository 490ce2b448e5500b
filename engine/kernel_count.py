"""How many Triton kernel variants a stretch of start-up made, and how many of them were
compiled rather than loaded from the on-disk cache (for the warm-up's report: the cost
of a start on a fresh machine is the compiled ones).

Variants: entries in the in-memory caches of the JIT functions of the `kernels` package
(one per specialisation launched). Compiled: new entries in Triton's cache directory (a
compile writes one; a variant loaded from there writes none). Both are -1 where they
cannot be told (no Triton, the interpreter: nothing is compiled)."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass


def _jit_functions() -> list:
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []
    out = []
    for name, module in list(sys.modules.items()):
        if module is not None and name.partition(".")[0] == "loramux_kernels":
            out += [v for v in vars(module).values() if isinstance(v, JITFunction)]
    return out


def _variants() -> int:
    """-1 where this Triton keeps its caches otherwise (a count must never fail a start)."""
    total = 0
    try:
        for fn in _jit_functions():
            for entry in getattr(fn, "device_caches", {}).values():
                total += len(entry[0])   # (kernel cache, ...) per device
    except (TypeError, IndexError, KeyError, AttributeError):
        return -1
    return total


def _cache_entries() -> int:
    try:
        from triton import knobs
        return len(os.listdir(knobs.cache.dir))
    except (ImportError, OSError, AttributeError):
        return 0


@dataclass(frozen=True)
class KernelCount:
    variants: int    # kernel variants made (-1: unknown)
    compiled: int    # of them compiled, not loaded from the disk cache (-1: unknown)
    _start: tuple[int, int] = (0, 0)

    @staticmethod
    def start() -> "KernelCount":
        return KernelCount(-1, -1, (_variants(), _cache_entries()))

    def done(self) -> "KernelCount":
        """The count since `start`."""
        now = _variants()
        if not _jit_functions() or now < 0 or self._start[0] < 0:
            return KernelCount(-1, -1)
        variants = now - self._start[0]
        return KernelCount(variants, min(variants, _cache_entries() - self._start[1]))

    def __str__(self) -> str:
        if self.variants < 0:
            return "kernel variants not counted"
        return (f"{self.variants} kernel variants ({self.compiled} compiled, "
                f"{self.variants - self.compiled} from the disk cache)")
