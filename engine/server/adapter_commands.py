"""Applies AdapterCommands from the control plane to the Engine and builds their acks.

Commands are idempotent so that the control plane can replay its desired state at any
time: loading a name already loaded from the same path (and, when the command names one,
the same content version) only updates its pin.

A load that must read files (a new name, or new weights under a name) is read and
validated on a reader thread (Engine.read_adapter) while the step thread keeps stepping;
`poll`, on the step thread, registers each finished read and acks it. Commands for a name
whose read is in flight wait behind it, in order; other names are not held up.

A load that finds no free place in the host tier (counting the reads in flight) is lazy:
its copy could only displace another adapter's, so loading thousands of adapters would
read and convert each one only to evict an earlier one. It is checked without reading
the weights (config, header, shapes, dtypes, file size) and registered on disk; the
weights are read and checked in full when a request first needs them, and a bad payload
then fails only the requests naming it (Engine.read_adapter). Pinned loads always read."""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from loramux_core.errors import AdapterNotFoundError, error_code
from loramux_core.v1 import engine_pb2

_Kind = engine_pb2.AdapterCommandKind
_Ack = engine_pb2.AdapterAck


@dataclass(frozen=True)
class LoadedAdapter:
    path: str
    adapter_id: int
    version: str = ""
    # the version the load named, which the read accepted for these bytes: one recorded
    # with an earlier digest names them too, so a load naming it again needs no read
    asked: str = ""


MIN_READER_THREADS = 8


def reader_threads_for(engine) -> int:
    """One reader thread per loader process at least: a thread only waits on its loader,
    and fewer threads than loaders would leave loaders idle while loads queue."""
    loaders = getattr(engine, "adapter_loaders", None)
    return max(MIN_READER_THREADS, loaders.processes if loaders is not None else 0)


class AdapterCommands:
    """Owns the name -> (path, id) view of what this engine was told to load."""

    def __init__(self, engine, reader_threads: int | None = None):
        """`reader_threads`: loads read at once (the control plane sends loads of
        different names concurrently; reads and conversions release the GIL); default:
        reader_threads_for(engine)."""
        self._engine = engine
        if reader_threads is None:
            reader_threads = reader_threads_for(engine)
        self.loaded: dict[str, LoadedAdapter] = {}
        self._reader = ThreadPoolExecutor(reader_threads, thread_name_prefix="adapter-read")
        # name -> (command, its read, whether the read only checks: `lazy` below)
        self._reads: dict[str, tuple[engine_pb2.AdapterCommand, Future, bool]] = {}
        self._queued: dict[str, deque] = {}  # name -> commands behind its read in flight

    def submit(self, cmd: engine_pb2.AdapterCommand) -> list[_Ack]:
        """Apply `cmd`, start its read, or queue it behind its name's read in flight;
        returns the acks ready now (the rest come from `poll`)."""
        if cmd.name in self._reads:
            self._queued.setdefault(cmd.name, deque()).append(cmd)
            return []
        if self._needs_read(cmd):
            lazy = not cmd.pinned and self._engine.host_copies_free() <= self._full_reads()
            self._reads[cmd.name] = (cmd, self._reader.submit(
                self._engine.read_adapter, cmd.name, cmd.path, cmd.version or None, lazy),
                lazy)
            return []
        return [self._ack(cmd, lambda: self._dispatch(cmd))]

    def poll(self) -> list[_Ack]:
        """On the step thread: register finished reads, then run what queued behind them."""
        acks = []
        for name, (cmd, fut, _) in list(self._reads.items()):
            if not fut.done():
                continue
            del self._reads[name]
            acks.append(self._ack(cmd, lambda: self._register(cmd, fut.result())))
            queued = self._queued.pop(name, deque())
            while queued and name not in self._reads:
                acks += self.submit(queued.popleft())
            if queued:  # a queued load started a new read: the rest wait behind it
                self._queued.setdefault(name, deque()).extendleft(reversed(queued))
        return acks

    def _full_reads(self) -> int:
        """Reads in flight that will take a host copy each."""
        return sum(not lazy for _, _, lazy in self._reads.values())

    @property
    def num_reading(self) -> int:
        return len(self._reads)

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)

    def _needs_read(self, cmd: engine_pb2.AdapterCommand) -> bool:
        have = self.loaded.get(cmd.name)
        return (cmd.kind == _Kind.ADAPTER_COMMAND_KIND_LOAD
                and (have is None or have.path != cmd.path
                     or cmd.version not in ("", have.version, have.asked)))

    def _ack(self, cmd: engine_pb2.AdapterCommand, run) -> _Ack:
        """Run one command; every failure becomes a not-ok ack with a status code. A LOAD
        acks the version of the files it holds under the name."""
        ack = _Ack(command_id=cmd.command_id, ok=True)
        try:
            ack.adapter_id = run()
            if cmd.kind == _Kind.ADAPTER_COMMAND_KIND_LOAD:
                ack.version = self.loaded[cmd.name].version
        except Exception as exc:  # noqa: BLE001 - reported to the caller, engine keeps going
            ack.ok = False
            ack.code = error_code(exc)
            ack.message = str(exc) or type(exc).__name__
        return ack

    def _register(self, cmd: engine_pb2.AdapterCommand, read) -> int:
        # New weights under the same name get a new id; the engine retires the old one
        # once its requests end.
        adapter_id = self._engine.register_adapter(read, pinned=cmd.pinned)
        self.loaded[cmd.name] = LoadedAdapter(cmd.path, adapter_id, read.version, cmd.version)
        return adapter_id

    def _dispatch(self, cmd: engine_pb2.AdapterCommand) -> int:
        if cmd.kind == _Kind.ADAPTER_COMMAND_KIND_LOAD:
            return self._set_pin(cmd.name, cmd.pinned)  # same path: no read
        if cmd.kind == _Kind.ADAPTER_COMMAND_KIND_UNLOAD:
            return self._unload(cmd.name)
        if cmd.kind in (_Kind.ADAPTER_COMMAND_KIND_PIN, _Kind.ADAPTER_COMMAND_KIND_UNPIN):
            return self._set_pin(cmd.name, cmd.kind == _Kind.ADAPTER_COMMAND_KIND_PIN)
        raise ValueError(f"adapter command kind {cmd.kind} is not supported")

    def _set_pin(self, name: str, pinned: bool) -> int:
        have = self.loaded.get(name)
        if have is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded on this engine")
        if self._engine.adapter_pinned(have.adapter_id) != pinned:
            self._engine.set_adapter_pinned(name, pinned)
        return have.adapter_id

    def _unload(self, name: str) -> int:
        have = self.loaded.pop(name, None)
        try:
            self._engine.remove_adapter(name)
        except AdapterNotFoundError:
            if have is None:
                raise
        return have.adapter_id if have else 0
