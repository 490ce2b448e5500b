"""The engine server reads as many adapter loads at once as the engine has loader
processes (engine/server/adapter_commands.py): a thread per loader at least, so loads do
not queue for a thread while loaders sit idle. The engine here is a stand-in whose reads
meet at a barrier: they all complete only if they all run at once."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from loramux_engine.server.adapter_commands import MIN_READER_THREADS, AdapterCommands
from loramux_core.v1 import engine_pb2

LOADERS = MIN_READER_THREADS + 4


class MeetingReads:
    """read_adapter blocks until `parties` reads are in progress at once."""

    def __init__(self, loaders: int, parties: int):
        self.adapter_loaders = SimpleNamespace(processes=loaders)
        self._barrier = threading.Barrier(parties, timeout=5)

    def host_copies_free(self) -> int:
        return 10_000

    def read_adapter(self, name, path, version, lazy):
        self._barrier.wait()
        return SimpleNamespace(name=name, version="v")

    def register_adapter(self, read, pinned=False) -> int:
        return int(read.name.removeprefix("a")) + 1


def load(i: int) -> engine_pb2.AdapterCommand:
    return engine_pb2.AdapterCommand(command_id=f"c{i}", name=f"a{i}", path=f"/adapters/a{i}",
                                     kind=engine_pb2.ADAPTER_COMMAND_KIND_LOAD)


def acks_of(commands: AdapterCommands, n: int, timeout_s: float = 20.0) -> list:
    acks, deadline = [], time.monotonic() + timeout_s
    while len(acks) < n and time.monotonic() < deadline:
        acks += commands.poll()
        time.sleep(0.01)
    return acks


def test_as_many_reads_at_once_as_loader_processes():
    commands = AdapterCommands(MeetingReads(LOADERS, LOADERS))
    try:
        for i in range(LOADERS):
            assert commands.submit(load(i)) == []
        acks = acks_of(commands, LOADERS)
        assert len(acks) == LOADERS and all(a.ok for a in acks), [a.message for a in acks]
    finally:
        commands.close()


def test_an_engine_without_loader_processes_keeps_the_minimum():
    commands = AdapterCommands(MeetingReads(0, MIN_READER_THREADS))
    try:
        for i in range(MIN_READER_THREADS):
            commands.submit(load(i))
        acks = acks_of(commands, MIN_READER_THREADS)
        assert len(acks) == MIN_READER_THREADS and all(a.ok for a in acks)
    finally:
        commands.close()
