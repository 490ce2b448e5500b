"""Which admin mutations may run at once: calls on different adapter names run
concurrently (each validating files and waiting on engines while the others do), calls on
one name run one at a time in arrival order, and a replay runs alone.

    async with locks.name("a"):     # shared with other names; exclusive for "a"
        ...
    async with locks.everything():  # waits for every name holder; new ones wait for it
        ...

A replay that is waiting goes first: name holders that arrive after it wait, so a steady
stream of admin calls cannot starve an engine's replay."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class AdminLocks:
    def __init__(self):
        self._cond = asyncio.Condition()
        self._names: dict[str, asyncio.Lock] = {}
        self._users: dict[str, int] = {}   # name -> holders and waiters of its lock
        self._shared = 0                   # name holders past the replay gate
        self._exclusive = False
        self._exclusive_waiting = 0

    @asynccontextmanager
    async def name(self, name: str) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._exclusive and not self._exclusive_waiting)
            self._shared += 1
            self._users[name] = self._users.get(name, 0) + 1
            lock = self._names.setdefault(name, asyncio.Lock())
        try:
            async with lock:
                yield
        finally:
            async with self._cond:
                self._shared -= 1
                self._users[name] -= 1
                if not self._users[name]:
                    del self._users[name], self._names[name]
                self._cond.notify_all()

    @asynccontextmanager
    async def everything(self) -> AsyncIterator[None]:
        async with self._cond:
            self._exclusive_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._exclusive and not self._shared)
            finally:
                self._exclusive_waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            async with self._cond:
                self._exclusive = False
                self._cond.notify_all()

    def busy(self, name: str) -> bool:
        """A mutation of `name` (or a replay) is running or waiting."""
        return self._exclusive or name in self._users
