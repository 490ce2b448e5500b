"""AdapterManager: the adapter lifecycle (REGISTERED -> LOADED -> UNLOADING -> REGISTERED)
over the registry, the engine replicas' links and the table publisher.

An adapter is placed on every replica, or on the replicas its load named. Commands go to
the placed replicas that are up; a replica that is down (or restarts) is brought to the
desired state by the replay when it (re)connects. Mutations of different names run
concurrently (file validation and engine reads overlap), those of one name one at a time,
and a replay alone (services/control/locks.py), so a replay never interleaves with an admin
call. Errors are AdminError(status code, message)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import structlog
from loramux.v1 import adapter_admin_pb2 as pb

from loramux_core.file_digest import FINGERPRINT_PREFIX
from loramux_core.v1 import engine_pb2
from loramux_services.common.messages import bounded
from loramux_services.control.engine_link import EngineLink, EngineUnavailable
from loramux_services.control.group_commit import GroupCommit
from loramux_services.control.locks import AdminLocks
from loramux_services.control.paths import AdapterRoots, PathRefused, check_name
from loramux_services.control.registry import AdapterRecord, Registry
from loramux_services.control.table_publisher import TablePublisher

_K = engine_pb2.AdapterCommandKind
REGISTERED, LOADED, UNLOADING = (pb.ADAPTER_STATE_REGISTERED, pb.ADAPTER_STATE_LOADED,
                                 pb.ADAPTER_STATE_UNLOADING)
# Items of one LoadAdapters batch in flight at once: enough to keep every engine reader and
# the validation threads busy, few enough that one batch leaves room for other calls.
BATCH_PARALLEL = 64
# LoadAdapters item: (name, path or None, pinned or None, replicas)
LoadItem = tuple[str, "str | None", "bool | None", "list[int] | None"]
# Validator: path inside the roots -> (rank, target modules, content version); raises
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
                 links: list[EngineLink], table: TablePublisher, checker: Checker | None = None):
        """`links`: one per engine replica, by replica index. `checker`: when given, a
        LoadAdapter that registers a new name checks the files with it and lets the
        engines read and hash them once (the version comes back in their acks) instead
        of reading and hashing them here first."""
        self.registry, self.roots, self.validator = registry, roots, validator
        self.checker = checker
        self.links, self.table = links, table
        self._locks = AdminLocks()
        self._group = GroupCommit(registry)  # loads' registry writes: one commit per turn
        self._log = structlog.get_logger().bind(component="adapters")

    def require(self, name: str) -> AdapterRecord:
        if (why := check_name(name)) is not None:
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT, why)
        rec = self.registry.get(name)
        if rec is None:
            raise AdminError(grpc.StatusCode.NOT_FOUND, f"adapter {name!r} is not registered")
        return rec

    def placed(self, rec: AdapterRecord) -> list[int]:
        """The replicas `rec` is placed on."""
        return list(rec.replicas) if rec.replicas else list(range(len(self.links)))

    def placement(self, replicas: list[int] | None) -> tuple[int, ...] | None:
        """A load's replicas as stored (() = every replica); None: not given."""
        if not replicas:
            return None
        bad = [i for i in replicas if not 0 <= i < len(self.links)]
        if bad:
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"replicas {bad}: there are {len(self.links)} engine replica(s), "
                             f"0 to {len(self.links) - 1}")
        chosen = tuple(sorted(set(replicas)))
        return () if len(chosen) == len(self.links) else chosen

    def _save(self, rec: AdapterRecord) -> AdapterRecord:
        rec = self.registry.put(rec, defer=self._group.active())
        self.table.publish_later(self.registry.all)
        return rec

    async def register(self, name: str, path: str) -> AdapterRecord:
        async with self._locks.name(name):
            return await self._register(name, path)

    async def _register(self, name: str, path: str, check_only: bool = False) -> AdapterRecord:
        """`check_only`: a new name whose version the engines' load acks will give."""
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
        if have is not None and have.version.startswith(FINGERPRINT_PREFIX) and self.checker:
            # an engine registered it without reading it: unchanged files keep that version
            if (await self._validate(name, real, True, fingerprint=True))[2] == have.version:
                return have
        rank, targets, version = await self._validate(name, real, check_only and have is None)
        if have is not None:  # registering again: the files as they are now are the version
            if have.version == version:
                return have
            self._log.info("revalidated", adapter=name, version=version)
            return self._save(have.evolve(rank=rank, target_modules=targets, version=version))
        self._log.info("registered", adapter=name, path=real, rank=rank, version=version)
        return self._save(AdapterRecord(name, real, rank=rank, target_modules=targets,
                                        version=version))

    async def _validate(self, name: str, path: str, check_only: bool = False,
                        fingerprint: bool = False) -> tuple[int, tuple[str, ...], str]:
        """The validator (the checker, with no version, or with the files' fingerprint
        when `fingerprint`, when `check_only`), off the event loop; its refusals as
        AdminErrors."""
        from loramux_core.errors import AdapterError
        try:
            if check_only:
                rank, targets, *fp = await asyncio.to_thread(self.checker, path)
                return rank, targets, fp[0] if fingerprint and fp else ""
            return await asyncio.to_thread(self.validator, path)
        except PathRefused as err:
            raise AdminError(grpc.StatusCode.PERMISSION_DENIED, str(err)) from None
        except AdapterError as err:
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"adapter {name!r} is not valid for the base model: {err}") from None
        except OSError as err:  # e.g. no permission on a file inside the root
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"adapter {name!r} cannot be read: {err.strerror}") from None

    async def load(self, name: str, path: str | None, pinned: bool | None,
                   replicas: list[int] | None = None) -> AdapterRecord:
        """Register (when `path` is given) and load on `replicas` (None: every replica, or
        the placement a loaded adapter has). `pinned` None keeps the record's pin. A
        refused load changes nothing: a name registered by this call is forgotten. Its
        registry writes are committed before it returns, in one transaction with those
        of the loads that finish beside it (services/control/group_commit.py)."""
        async with self._group.deferring():
            return await self._load_one(name, path, pinned, replicas)

    async def _load_one(self, name: str, path: str | None, pinned: bool | None,
                        replicas: list[int] | None) -> AdapterRecord:
        async with self._locks.name(name):
            placement = self.placement(replicas)
            before = self.registry.get(name)
            check_only = self.checker is not None and before is None
            rec = await self._register(name, path, check_only) if path else self.require(name)
            fresh = before is None or before.version != rec.version
            try:
                return await self._load(rec, rec.pinned if pinned is None else pinned, fresh,
                                        rec.replicas if placement is None else placement)
            except AdminError:
                if path and before is None:
                    self.registry.delete(name)
                    self.table.publish_later(self.registry.all)
                raise

    async def load_many(self, items: list[LoadItem]) -> list[AdapterRecord | AdminError]:
        """Each item loaded as `load` would (BATCH_PARALLEL at a time; items of one name
        in order, as concurrent calls would be): its record, or the AdminError that
        refused it alone. The registry writes of the whole batch are committed once,
        before this returns."""
        gate = asyncio.Semaphore(BATCH_PARALLEL)

        async def one(item: LoadItem):
            async with gate:
                try:
                    return await self.load(*item)
                except AdminError as err:
                    return err
                except Exception as err:  # noqa: BLE001 - one item's failure stays its own
                    self._log.exception("batch_item_failed", adapter=item[0])
                    return AdminError(grpc.StatusCode.INTERNAL,
                                      f"loading adapter {item[0]!r} failed: {err}")
        async with self._group.deferring():
            return list(await asyncio.gather(*(one(i) for i in items)))

    async def _load(self, rec: AdapterRecord, pinned: bool, fresh: bool,
                    placement: tuple[int, ...]) -> AdapterRecord:
        """`fresh`: the record's version is newer than what the engines may hold."""
        if rec.state == UNLOADING:
            raise AdminError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"adapter {rec.name!r} is still unloading; retry when it is REGISTERED")
        if rec.state == LOADED and rec.pinned == pinned and not fresh and rec.replicas == placement:
            return rec
        before = set(self.placed(rec)) if rec.state == LOADED else set()
        target = rec.evolve(replicas=placement)
        acks = await self._command(self.placed(target), _K.ADAPTER_COMMAND_KIND_LOAD, rec.name,
                                   rec.path, pinned, rec.version)
        refused = [(i, ack) for i, ack in acks.items() if not ack.ok]
        if refused:
            await self._undo_loads([i for i, ack in acks.items() if ack.ok and i not in before], rec.name)
            raise _ack_error(refused[0][1], f"loading adapter {rec.name!r} failed"
                             + (f" on replica {refused[0][0]}" if len(self.links) > 1 else ""))
        if not rec.version:  # the engines read and hashed the files: their version
            target = target.evolve(version=await self._acked_version(acks, rec.name, before))
        dropped = sorted(before - set(self.placed(target)))
        if dropped:
            await self._command(dropped, _K.ADAPTER_COMMAND_KIND_UNLOAD, rec.name, optional=True)
        loads = rec.loads + (rec.state != LOADED)
        adapter_id = acks[min(acks)].adapter_id if acks else rec.adapter_id
        self._log.info("loaded", adapter=rec.name, adapter_id=adapter_id, pinned=pinned,
                       replicas=sorted(acks))
        return self._save(target.evolve(state=LOADED, pinned=pinned, adapter_id=adapter_id,
                                        loads=loads))

    async def _acked_version(self, acks: dict, name: str, before: set[int]) -> str:
        """The one version the replicas' acks name; when they read different files (the
        files changed meanwhile), the load is undone and refused. A replica that only
        checked the files acks their fingerprint; beside replicas that read them, the
        version they read is the record's (the fingerprint replica still refuses files
        changed since, at its first read)."""
        versions = {ack.version for ack in acks.values()}
        read = {v for v in versions if not v.startswith(FINGERPRINT_PREFIX)}
        if len(read) == 1 and len(versions) == 2:
            versions = read
        if len(versions) == 1 and "" not in versions:
            return versions.pop()
        await self._undo_loads([i for i in acks if i not in before], name)
        raise AdminError(grpc.StatusCode.FAILED_PRECONDITION,
                         f"adapter {name!r}: the engine replicas read different files (they "
                         "changed while being loaded); load it again")

    async def _undo_loads(self, replicas: list[int], name: str) -> None:
        """A refused load leaves no replica holding what it loaded (best effort)."""
        if replicas:
            await self._command(replicas, _K.ADAPTER_COMMAND_KIND_UNLOAD, name, optional=True)

    async def unload(self, name: str) -> AdapterRecord:
        async with self._locks.name(name):
            rec = self.require(name)
            if rec.state == REGISTERED:
                raise AdminError(grpc.StatusCode.FAILED_PRECONDITION, f"adapter {name!r} is not loaded")
            if rec.state == UNLOADING:
                return rec
            # Published before the engines hear of it: gateways refuse new requests first.
            rec = self._save(rec.evolve(state=UNLOADING))
            if not any(self.links[i].up for i in self.placed(rec)):
                # nothing in flight anywhere; the replay reconciles the engines
                return self._save(rec.evolve(state=REGISTERED, adapter_id=0))
            acks = await self._command(self.placed(rec), _K.ADAPTER_COMMAND_KIND_UNLOAD, name)
            for ack in acks.values():
                if not ack.ok and ack.code != engine_pb2.ERROR_CODE_NOT_FOUND:
                    raise _ack_error(ack, f"unloading adapter {name!r} failed")
            self._log.info("unloading", adapter=name)
            return rec

    async def unregister(self, name: str) -> None:
        async with self._locks.name(name):
            rec = self.require(name)
            if rec.state != REGISTERED:
                raise AdminError(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"adapter {name!r} is {pb.AdapterState.Name(rec.state)}; unload it first")
            self.registry.delete(name)
            self.table.publish_later(self.registry.all)
            self._log.info("unregistered", adapter=name)

    async def set_pinned(self, name: str, pinned: bool) -> AdapterRecord:
        async with self._locks.name(name):
            rec = self.require(name)
            if rec.state == LOADED and rec.pinned != pinned:
                kind = _K.ADAPTER_COMMAND_KIND_PIN if pinned else _K.ADAPTER_COMMAND_KIND_UNPIN
                acks = await self._command(self.placed(rec), kind, name)
                for ack in acks.values():
                    if not ack.ok:
                        raise _ack_error(ack, f"{'pinning' if pinned else 'unpinning'} {name!r} failed")
            return self._save(rec.evolve(pinned=pinned))

    async def _command(self, replicas: list[int], kind: int, name: str, path: str = "",
                       pinned: bool = False, version: str = "",
                       optional: bool = False) -> dict[int, engine_pb2.AdapterAck]:
        """Send one command to those of `replicas` that are up, concurrently: their acks,
        by replica. The others get it from the replay when they (re)connect. With none up,
        each gets the link's wait for a (re)starting engine; none answering is UNAVAILABLE
        (or, when `optional`, no acks)."""
        up = [i for i in replicas if self.links[i].up]
        wait_s = 0.0 if up else 5.0
        targets = up or replicas
        results = await asyncio.gather(
            *(self.links[i].command(kind, name, path, pinned, version, connect_wait_s=wait_s)
              for i in targets), return_exceptions=True)
        acks, errors = {}, []
        for i, result in zip(targets, results):
            if isinstance(result, EngineUnavailable):
                errors.append(f"replica {i}: {result}" if len(self.links) > 1 else str(result))
            elif isinstance(result, BaseException):
                raise result
            else:
                acks[i] = result
        if not acks and errors and not optional:
            raise AdminError(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {'; '.join(errors)}")
        return acks

    async def replay(self, replica: int, instance_id: str) -> None:
        """Bring a (re)connected replica to the desired state: load every LOADED adapter
        placed on it (with its pin), unload every UNLOADING one and every one no longer
        placed on it. Then the table says the engine `instance_id` was replayed: gateways
        send it requests that name adapters only from then on."""
        async with self._locks.everything():
            for rec in self.registry.all():
                if rec.state == LOADED and replica in self.placed(rec):
                    await self._replay_load(replica, rec)
                elif rec.state in (LOADED, UNLOADING):
                    await self._replay_unload(replica, rec)
            self.table.replayed[replica] = instance_id
            self.table.publish(self.registry.all())
        self._log.info("replayed", replica=replica, engine=instance_id)

    async def _replay_load(self, replica: int, rec: AdapterRecord) -> None:
        try:
            ack = await self.links[replica].command(_K.ADAPTER_COMMAND_KIND_LOAD, rec.name,
                                                    rec.path, rec.pinned, rec.version)
        except EngineUnavailable as err:
            self._log.warning("replay_failed", replica=replica, adapter=rec.name, error=str(err))
            return
        if not ack.ok:
            self._log.error("replay_load_refused", replica=replica, adapter=rec.name,
                            error=ack.message)
        elif replica == min(self.placed(rec)):  # the record shows the first replica's id
            self.registry.put(rec.evolve(adapter_id=ack.adapter_id))

    async def _replay_unload(self, replica: int, rec: AdapterRecord) -> None:
        try:
            await self.links[replica].command(_K.ADAPTER_COMMAND_KIND_UNLOAD, rec.name)
        except EngineUnavailable:
            return

    def on_event(self, ev: engine_pb2.EngineEvent) -> None:
        """An UNLOADING adapter becomes REGISTERED once no live replica holds it. (Events
        list every adapter: they are only read while some adapter is unloading.)"""
        unloading = self.registry.unloading()
        if not unloading:
            return
        held = {a.name for link in self.links if link.up for a in link.last_event.adapters}
        held |= {a.name for a in ev.adapters}
        for rec in unloading:
            if rec.name not in held and not self._locks.busy(rec.name):
                self._save(rec.evolve(state=REGISTERED, adapter_id=0))
                self._log.info("unloaded", adapter=rec.name)
