"""Applies AdapterCommands from the control plane to the Engine and builds their acks.

Commands are idempotent so that the control plane can replay its desired state at any
time: loading a name already loaded from the same path (and, when the command names one,
the same version) only updates its pin."""
from __future__ import annotations

from dataclasses import dataclass

from loramux.v1 import engine_pb2

from engine.errors import AdapterNotFoundError
from engine.server.convert import error_code

_Kind = engine_pb2.AdapterCommandKind


@dataclass(frozen=True)
class LoadedAdapter:
    path: str
    adapter_id: int
    pinned: bool
    version: str = ""


class AdapterCommands:
    """Owns the name -> (path, id) view of what this engine was told to load."""

    def __init__(self, engine):
        self._engine = engine
        self.loaded: dict[str, LoadedAdapter] = {}

    def apply(self, cmd: engine_pb2.AdapterCommand) -> engine_pb2.AdapterAck:
        """Run one command; every failure becomes a not-ok ack with a status code."""
        ack = engine_pb2.AdapterAck(command_id=cmd.command_id, ok=True)
        try:
            ack.adapter_id = self._dispatch(cmd)
        except Exception as exc:  # noqa: BLE001 - reported to the caller, engine keeps going
            ack.ok = False
            ack.code = error_code(exc)
            ack.message = str(exc) or type(exc).__name__
        return ack

    def _dispatch(self, cmd: engine_pb2.AdapterCommand) -> int:
        if cmd.kind == _Kind.ADAPTER_COMMAND_KIND_LOAD:
            return self._load(cmd.name, cmd.path, cmd.pinned, cmd.version)
        if cmd.kind == _Kind.ADAPTER_COMMAND_KIND_UNLOAD:
            return self._unload(cmd.name)
        if cmd.kind in (_Kind.ADAPTER_COMMAND_KIND_PIN, _Kind.ADAPTER_COMMAND_KIND_UNPIN):
            return self._pin(cmd.name, cmd.kind == _Kind.ADAPTER_COMMAND_KIND_PIN)
        raise ValueError(f"adapter command kind {cmd.kind} is not supported")

    def _load(self, name: str, path: str, pinned: bool, version: str = "") -> int:
        have = self.loaded.get(name)
        same = have is not None and have.path == path and version in ("", have.version)
        if same and have.pinned == pinned:
            return have.adapter_id
        if same and hasattr(self._engine, "set_adapter_pinned"):
            self._engine.set_adapter_pinned(name, pinned)
            self.loaded[name] = LoadedAdapter(path, have.adapter_id, pinned, have.version)
            return have.adapter_id
        # New weights (or a pin change the engine can only take as a reload) under the same
        # name get a new id; the engine retires the old one once its requests end.
        adapter_id = self._engine.add_adapter(name, path, pinned=pinned, version=version or None)
        self.loaded[name] = LoadedAdapter(path, adapter_id, pinned, self._version_of(adapter_id))
        return adapter_id

    def _version_of(self, adapter_id: int) -> str:
        stats = self._engine.stats().get("adapters", {}) if hasattr(self._engine, "stats") else {}
        return str(stats.get(adapter_id, {}).get("version", ""))

    def _unload(self, name: str) -> int:
        have = self.loaded.pop(name, None)
        try:
            self._engine.remove_adapter(name)
        except AdapterNotFoundError:
            if have is None:
                raise
        return have.adapter_id if have else 0

    def _pin(self, name: str, pinned: bool) -> int:
        have = self.loaded.get(name)
        if have is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded on this engine")
        return self._load(name, have.path, pinned, have.version)
