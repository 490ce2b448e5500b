"""services/control/locks.py: admin calls on different names overlap, on one name they run
in order, a replay runs alone and is not starved by later calls."""
from __future__ import annotations

import asyncio

from loramux_services.control.locks import AdminLocks


async def _hold(locks: AdminLocks, name: str | None, log: list, tag: str,
                release: asyncio.Event) -> None:
    ctx = locks.everything() if name is None else locks.name(name)
    async with ctx:
        log.append(f"{tag} in")
        await release.wait()
        log.append(f"{tag} out")


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_different_names_overlap_one_name_waits():
    async def run():
        locks, log = AdminLocks(), []
        go = {t: asyncio.Event() for t in ("a1", "b", "a2")}
        tasks = [asyncio.create_task(_hold(locks, n, log, t, go[t]))
                 for n, t in (("a", "a1"), ("b", "b"), ("a", "a2"))]
        await _settle()
        assert log == ["a1 in", "b in"]          # b overlaps a1; a2 waits for a1
        assert locks.busy("a") and locks.busy("b") and not locks.busy("c")
        go["a2"].set()
        await _settle()
        assert "a2 in" not in log
        go["a1"].set()
        await _settle()
        assert log == ["a1 in", "b in", "a1 out", "a2 in", "a2 out"]
        go["b"].set()
        await asyncio.gather(*tasks)
        assert not locks.busy("a") and not locks._names   # nothing kept per name
    asyncio.run(run())


def test_replay_waits_for_holders_and_goes_before_later_calls():
    async def run():
        locks, log = AdminLocks(), []
        go = {t: asyncio.Event() for t in ("a", "replay", "b")}
        first = asyncio.create_task(_hold(locks, "a", log, "a", go["a"]))
        await _settle()
        replay = asyncio.create_task(_hold(locks, None, log, "replay", go["replay"]))
        await _settle()
        later = asyncio.create_task(_hold(locks, "b", log, "b", go["b"]))
        await _settle()
        assert log == ["a in"] and locks.busy("zzz") is False
        go["a"].set()
        await _settle()
        assert log == ["a in", "a out", "replay in"] and locks.busy("zzz")
        go["b"].set()
        await _settle()
        assert "b in" not in log                 # b waits for the replay
        go["replay"].set()
        await asyncio.gather(first, replay, later)
        assert log[-2:] == ["b in", "b out"]
    asyncio.run(run())
