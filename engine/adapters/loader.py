"""The disk tier: reading an adapter's files into host memory off the step path.

Reads run on a few background threads (the file is memory-mapped and converted straight
into a reused, page-locked host buffer: engine/lora/weights.py; CPU work the step loop
should not wait for), so several adapters are read at once. Each loaded version remembers a
fingerprint of its files (size and modification time); a read for an id whose files
changed since the id was loaded fails, because an id stands for the weights it was
loaded with and must never silently serve others.
"""
from __future__ import annotations

import os
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable, NamedTuple

from engine.errors import AdapterError

_FILES = ("adapter_config.json", "adapter_model.safetensors")


def fingerprint(path: str | Path) -> tuple:
    """(name, size, mtime_ns) of the adapter's config and weights files."""
    out = []
    for name in _FILES:
        try:
            st = os.stat(Path(path) / name)
        except OSError:
            continue
        out.append((name, st.st_size, st.st_mtime_ns))
    return tuple(out)


class LoadResult(NamedTuple):
    adapter_id: int
    weights: Any                   # LoRAWeights, None on failure
    error: Exception | None


class DiskLoader:
    """Background reads keyed by adapter id; `load_weights(path)` does the reading."""

    def __init__(self, load_weights: Callable[[str], Any], num_threads: int = 4):
        self._load_weights = load_weights
        self._num_threads = num_threads
        self._executor: ThreadPoolExecutor | None = None  # started on first use
        self._pending: dict[int, Future] = {}

    def read(self, path: str | Path) -> Any:
        """Synchronous read (admin loads: the caller waits for validation anyway)."""
        return self._load_weights(str(path))

    def submit(self, adapter_id: int, path: str, expected: tuple) -> None:
        """Start reading `adapter_id` from `path` unless already pending."""
        if adapter_id in self._pending:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._num_threads,
                                                thread_name_prefix="lora-disk")
        self._pending[adapter_id] = self._executor.submit(self.read_checked, path, expected)

    def read_checked(self, path: str, expected: tuple):
        """Read `path`, failing (AdapterError) unless its files still match `expected`."""
        if fingerprint(path) != expected:
            raise AdapterError(f"adapter files at {path} changed or vanished since this "
                               "version was loaded; load the name again to serve them",
                               feature="changed_on_disk")
        weights = self.read(path)
        if fingerprint(path) != expected:  # changed while being read
            raise AdapterError(f"adapter files at {path} changed while being read",
                               feature="changed_on_disk")
        return weights

    def is_pending(self, adapter_id: int) -> bool:
        return adapter_id in self._pending

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def collect(self) -> list[LoadResult]:
        """Finished reads (successful or not), without waiting."""
        done = [aid for aid, fut in self._pending.items() if fut.done()]
        out = []
        for aid in done:
            fut = self._pending.pop(aid)
            err = fut.exception()
            out.append(LoadResult(aid, None if err else fut.result(), err))
        return out

    def wait_any(self, timeout: float | None = None) -> None:
        """Block until at least one pending read finishes (only when nothing can run)."""
        if self._pending:
            wait(list(self._pending.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    def wait_all(self) -> None:
        """Block until every pending read has finished (collect() then returns them all):
        makes a run independent of read timing (tests, the lifecycle stress)."""
        wait(list(self._pending.values()))

    def cancel(self, adapter_id: int) -> None:
        """Forget a read (its result is discarded; a running read finishes harmlessly)."""
        fut = self._pending.pop(adapter_id, None)
        if fut is not None:
            fut.cancel()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
