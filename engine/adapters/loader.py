"""The disk tier: reading an adapter's files into host memory off the step path.

Reads run on a few background threads, so several adapters are read at once; each
thread hands its read to a loader process (engine/adapters/loader_pool.py: the file is
read once through loramux_core/safe_files.py and converted straight into a reused
shared, page-locked host buffer, engine/lora/weights.py; CPU work neither the step loop
nor its process should carry), or with `adapter_loaders=0` does it itself. Each loaded version remembers the content version of its files
(the bytes are read once and hashed, and the weights are built from those very bytes); a
read for an id whose files hash otherwise fails (AdapterChangedError), because an id
stands for the weights it was loaded with and must never silently serve others.
"""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable, NamedTuple


class LoadResult(NamedTuple):
    adapter_id: int
    weights: Any                   # LoRAWeights, None on failure
    error: Exception | None


class DiskLoader:
    """Background reads keyed by adapter id; `load_weights(path, expected_version)` does
    the reading (expected_version None: any version; the weights carry theirs)."""

    def __init__(self, load_weights: Callable[[str, str | None], Any], num_threads: int = 4,
                 on_close: Callable[[], None] = lambda: None):
        """`on_close`: stops what `load_weights` runs on (loader processes)."""
        self._load_weights = load_weights
        self._on_close = on_close
        self._num_threads = num_threads
        self._executor: ThreadPoolExecutor | None = None  # started on first use
        self._pending: dict[int, Future] = {}

    def read(self, path: str | Path, expected: str | None = None) -> Any:
        """Synchronous read (admin loads: the caller waits for validation anyway)."""
        return self._load_weights(str(path), expected)

    def submit(self, adapter_id: int, path: str, expected: str) -> None:
        """Start reading `adapter_id` from `path` unless already pending."""
        if adapter_id in self._pending:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._num_threads,
                                                thread_name_prefix="lora-disk")
        self._pending[adapter_id] = self._executor.submit(self.read, path, expected)

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
        self._on_close()
