"""Releases that garbage collection finds, done later by their owner at a safe point.

A finalizer (weakref.finalize, __del__) runs on whatever thread happens to allocate when
the collector starts: that can be the step thread in the middle of a CUDA-graph capture,
where any call that may synchronize (an event query, unregistering host memory)
invalidates the capture ("operation not permitted when stream is capturing"): a failed
warm-up, or a dead engine mid-traffic. So a finalizer that would touch CUDA only queues
its work here, and the owner runs the queue where it knows no capture is open on its
thread (the start of a step, before it hands out a buffer, at close).

    finalizer (any thread)  ──put──▶  ReleaseQueue  ──run──▶  owner, at a safe point

`put` takes no lock: a finalizer may fire on a thread that already holds the owner's
lock (the collector runs inside any allocation), and deque.append is atomic. Once the
owner is closed no safe point comes any more: work put then runs at once, unless this
thread is capturing (then it waits for a `run` that may never come: a leak, not a
broken capture). A queue whose owner is dropped without being closed (an engine a test
lets go) leaves its work to the next `run` of any queue: the work keeps alive what it
releases until then. Dropped with it, a page-locked buffer would be unmapped while
still registered, and the driver would copy from its old pages into the memory the next
mapping of those addresses gives to another adapter (a slot filled with stale bytes).
"""
from __future__ import annotations

import collections
import weakref
from collections.abc import Callable

import torch


def capturing() -> bool:
    """This thread is capturing a CUDA graph (False where CUDA was never initialized:
    asking then would initialize it)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


# the work of queues collected with work left in them, done by the next `run` of any queue
_orphans: collections.deque[tuple[Callable, tuple]] = collections.deque()


class ReleaseQueue:
    """Work queued by finalizers; `run` does it on the caller's thread."""

    def __init__(self):
        self._items: collections.deque[tuple[Callable, tuple]] = collections.deque()
        self._closed = False
        # a finalizer holds a strong reference to its queue's `put`: every item is in
        # by the time the queue itself is collected
        weakref.finalize(self, _orphans.extend, self._items)

    def put(self, fn: Callable, *args) -> None:
        """Queue `fn(*args)`; safe from a finalizer on any thread."""
        if self._closed and not capturing():
            fn(*args)
        else:
            self._items.append((fn, args))

    def run(self) -> int:
        """Do the queued work now, unless this thread is capturing a graph (then it stays
        queued for the next safe point); returns how many items ran."""
        if capturing():
            return 0
        return _drain(self._items) + _drain(_orphans)

    def close(self) -> None:
        """Run what is queued; from now on `put` runs its work at once (module docstring)."""
        self._closed = True
        self.run()

    def __len__(self) -> int:
        return len(self._items)


def _drain(items: collections.deque) -> int:
    done = 0
    while True:
        try:
            fn, args = items.popleft()
        except IndexError:
            return done
        fn(*args)
        done += 1
