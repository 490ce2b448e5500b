"""AdapterManager: the adapter lifecycle (REGISTERED -> LOADED -> UNLOADING -> REGISTERED)
over the registry, the engine link and the table publisher.

Mutations are serialized by one lock, so a replay after an engine (re)connect never
interleaves with an admin call. Errors are AdminError(status code, message)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import structlog
from loramux.v1 import adapter_admin_pb2 as pb

from loramux_core.v1 import engine_pb2
from services.common.messages import bounded
from services.control.engine_link import EngineLink, EngineUnavailable
from services.control.paths import AdapterRoots, PathRefused, check_name
from services.control.registry import AdapterRecord, Registry
from services.control.table_publisher import TablePublisher

_K = engine_pb2.AdapterCommandKind
REGISTERED, LOADED, UNLOADING = (pb.ADAPTER_STATE_REGISTERED, pb.ADAPTER_STATE_LOADED,
                                 pb.ADAPTER_STATE_UNLOADING)
# Validator: path inside the roots -> (rank, target modules, sha256 version); raises
# loramux_core.errors.AdapterError (AdapterPathError: outside the roots or through a link).
Validator = Callable[[str], tuple[int, tuple[str, ...], str]]


class AdminError(Exception):
    """A refused admin call: the gRPC status (see the table in adapter_admin.proto) and a
    bounded message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(bounded(message))
        self.code = code


def _ack_error(ack: engine_pb2.AdapterAck, what: str) -> AdminError:
    code = grpc.StatusCode.INTERNAL
    for c in grpc.StatusCode:
        if c.value[0] == ack.code:
            code = c
    if code == grpc.StatusCode.NOT_FOUND:  # the name is registered: the engine lacks it
        code = grpc.StatusCode.FAILED_PRECONDITION
    return AdminError(code, f"{what}: {ack.message}")


class AdapterManager:
    def __init__(self, registry: Registry, roots: AdapterRoots, validator: Validator,
                 link: EngineLink, table: TablePublisher):
        self.registry, self.roots, self.validator = registry, roots, validator
        self.link, self.table = link, table
        self._lock = asyncio.Lock()
        self._log = structlog.get_logger().bind(component="adapters")

    def require(self, name: str) -> AdapterRecord:
        if (why := check_name(name)) is not None:
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT, why)
        rec = self.registry.get(name)
        if rec is None:
            raise AdminError(grpc.StatusCode.NOT_FOUND, f"adapter {name!r} is not registered")
        return rec

    def _save(self, rec: AdapterRecord) -> AdapterRecord:
        rec = self.registry.put(rec)
        self.table.publish(self.registry.all())
        return rec

    async def register(self, name: str, path: str) -> AdapterRecord:
        async with self._lock:
            return await self._register(name, path)

    async def _register(self, name: str, path: str) -> AdapterRecord:
        if (why := check_name(name)) is not None:
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT, why)
        try:
            real = self.roots.canonical(path)
        except PathRefused as err:
            raise AdminError(grpc.StatusCode.PERMISSION_DENIED, str(err)) from None
        have = self.registry.get(name)
        if have is not None and have.path != real:
            raise AdminError(grpc.StatusCode.ALREADY_EXISTS,
                             f"adapter {name!r} is already registered from {have.path!r}")
        rank, targets, version = await self._validate(name, real)
        if have is not None:  # registering again: the files as they are now are the version
            if have.version == version:
                return have
            self._log.info("revalidated", adapter=name, version=version)
            return self._save(have.evolve(rank=rank, target_modules=targets, version=version))
        self._log.info("registered", adapter=name, path=real, rank=rank, version=version)
        return self._save(AdapterRecord(name, real, rank=rank, target_modules=targets,
                                        version=version))

    async def _validate(self, name: str, path: str) -> tuple[int, tuple[str, ...], str]:
        """The validator, off the event loop; its refusals as AdminErrors."""
        from loramux_core.errors import AdapterError
        try:
            return await asyncio.to_thread(self.validator, path)
        except PathRefused as err:
            raise AdminError(grpc.StatusCode.PERMISSION_DENIED, str(err)) from None
        except AdapterError as err:
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"adapter {name!r} is not valid for the base model: {err}") from None
        except OSError as err:  # e.g. no permission on a file inside the root
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"adapter {name!r} cannot be read: {err.strerror}") from None

    async def load(self, name: str, path: str | None, pinned: bool | None) -> AdapterRecord:
        """Register (when `path` is given) and load. `pinned` None keeps the record's pin.
        A refused load changes nothing: a name registered by this call is forgotten."""
        async with self._lock:
            before = self.registry.get(name)
            rec = await self._register(name, path) if path else self.require(name)
            fresh = before is None or before.version != rec.version
            try:
                return await self._load(rec, rec.pinned if pinned is None else pinned, fresh)
            except AdminError:
                if path and before is None:
                    self.registry.delete(name)
                    self.table.publish(self.registry.all())
                raise

    async def _load(self, rec: AdapterRecord, pinned: bool, fresh: bool) -> AdapterRecord:
        """`fresh`: the record's version is newer than what the engine may hold."""
        if rec.state == UNLOADING:
            raise AdminError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"adapter {rec.name!r} is still unloading; retry when it is REGISTERED")
        if rec.state == LOADED and rec.pinned == pinned and not fresh:
            return rec
        ack = await self._command(_K.ADAPTER_COMMAND_KIND_LOAD, rec.name, rec.path, pinned,
                                  rec.version)
        if not ack.ok:
            raise _ack_error(ack, f"loading adapter {rec.name!r} failed")
        loads = rec.loads + (rec.state != LOADED)
        self._log.info("loaded", adapter=rec.name, adapter_id=ack.adapter_id, pinned=pinned)
        return self._save(rec.evolve(state=LOADED, pinned=pinned, adapter_id=ack.adapter_id,
                                     loads=loads))

    async def unload(self, name: str) -> AdapterRecord:
        async with self._lock:
            rec = self.require(name)
            if rec.state == REGISTERED:
                raise AdminError(grpc.StatusCode.FAILED_PRECONDITION, f"adapter {name!r} is not loaded")
            if rec.state == UNLOADING:
                return rec
            # Published before the engine hears of it: gateways refuse new requests first.
            rec = self._save(rec.evolve(state=UNLOADING))
            if not self.link.up:  # nothing in flight anywhere; the replay reconciles the engine
                return self._save(rec.evolve(state=REGISTERED, adapter_id=0))
            ack = await self._command(_K.ADAPTER_COMMAND_KIND_UNLOAD, name)
            if not ack.ok and ack.code != engine_pb2.ERROR_CODE_NOT_FOUND:
                raise _ack_error(ack, f"unloading adapter {name!r} failed")
            self._log.info("unloading", adapter=name)
            return rec

    async def unregister(self, name: str) -> None:
        async with self._lock:
            rec = self.require(name)
            if rec.state != REGISTERED:
                raise AdminError(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"adapter {name!r} is {pb.AdapterState.Name(rec.state)}; unload it first")
            self.registry.delete(name)
            self.table.publish(self.registry.all())
            self._log.info("unregistered", adapter=name)

    async def set_pinned(self, name: str, pinned: bool) -> AdapterRecord:
        async with self._lock:
            rec = self.require(name)
            if rec.state == LOADED and rec.pinned != pinned:
                kind = _K.ADAPTER_COMMAND_KIND_PIN if pinned else _K.ADAPTER_COMMAND_KIND_UNPIN
                ack = await self._command(kind, name)
                if not ack.ok:
                    raise _ack_error(ack, f"{'pinning' if pinned else 'unpinning'} {name!r} failed")
            return self._save(rec.evolve(pinned=pinned))

    async def _command(self, kind: int, name: str, path: str = "", pinned: bool = False,
                       version: str = "") -> engine_pb2.AdapterAck:
        try:
            return await self.link.command(kind, name, path, pinned, version)
        except EngineUnavailable as err:
            raise AdminError(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {err}") from None

    async def replay(self, instance_id: str) -> None:
        """Bring a (re)connected engine to the desired state: load every LOADED adapter
        (with its pin), finish every UNLOADING one."""
        async with self._lock:
            for rec in self.registry.all():
                if rec.state == LOADED:
                    await self._replay_load(rec)
                elif rec.state == UNLOADING:
                    await self._replay_unload(rec)
            self.table.publish(self.registry.all())
        self._log.info("replayed", engine=instance_id)

    async def _replay_load(self, rec: AdapterRecord) -> None:
        try:
            ack = await self.link.command(_K.ADAPTER_COMMAND_KIND_LOAD, rec.name, rec.path,
                                          rec.pinned, rec.version)
        except EngineUnavailable as err:
            self._log.warning("replay_failed", adapter=rec.name, error=str(err))
            return
        if ack.ok:
            self.registry.put(rec.evolve(adapter_id=ack.adapter_id))
        else:
            self._log.error("replay_load_refused", adapter=rec.name, error=ack.message)

    async def _replay_unload(self, rec: AdapterRecord) -> None:
        try:
            await self.link.command(_K.ADAPTER_COMMAND_KIND_UNLOAD, rec.name)
        except EngineUnavailable:
            return

    def on_event(self, ev: engine_pb2.EngineEvent) -> None:
        """An UNLOADING adapter becomes REGISTERED once the engine no longer holds it."""
        held = {a.name for a in ev.adapters}
        for rec in self.registry.all():
            if rec.state == UNLOADING and rec.name not in held and not self._lock.locked():
                self._save(rec.evolve(state=REGISTERED, adapter_id=0))
                self._log.info("unloaded", adapter=rec.name)
