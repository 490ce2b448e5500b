"""Group commit of the registry's writes: many admin calls finishing at once share one
SQLite transaction, and a LoadAdapters batch commits once for all its items.

Each committed transaction syncs the file (synchronous=FULL), which takes milliseconds
and blocks the event loop; with two writes per load, a thousand loads spent seconds of the
control plane's only thread on syncs. Inside `deferring()` the registry's writes are seen
by readers at once and wait for `committed()`, which every call awaits before it answers:
what a call answered is on disk, as with one transaction per write.

    async with group.deferring():
        ... registry.put(rec, defer=group.active()) ...
    # on leaving: committed, together with what other calls wrote meanwhile
"""
from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from loramux_services.control.registry import Registry

# Set while a call defers its writes; tasks it starts (a batch's items) inherit it.
_deferring: contextvars.ContextVar[bool] = contextvars.ContextVar("deferring", default=False)


class GroupCommit:
    def __init__(self, registry: Registry):
        self.registry = registry
        self._commit: asyncio.Future | None = None

    @staticmethod
    def active() -> bool:
        """Whether the running call defers its registry writes."""
        return _deferring.get()

    @asynccontextmanager
    async def deferring(self) -> AsyncIterator[None]:
        """Defer the registry writes made inside; on leaving (also by an error), wait for
        their commit. Nested uses commit once, when the outermost one leaves."""
        outer = _deferring.get()
        token = _deferring.set(True)
        try:
            yield
        finally:
            _deferring.reset(token)
            if not outer:
                await self.committed()

    async def committed(self) -> None:
        """Returns once every deferred write is committed. Callers that arrive while a
        commit waits for its turn of the event loop share it."""
        if self._commit is None or self._commit.done():
            self._commit = asyncio.ensure_future(self._commit_soon())
        await asyncio.shield(self._commit)

    async def _commit_soon(self) -> None:
        await asyncio.sleep(0)  # the calls finishing in this turn join this commit
        self.registry.flush()
