"""AdapterAdminService over grpc.aio: request checks and proto conversion around the
AdapterManager."""
from __future__ import annotations

import asyncio
import base64
import functools
import time

import grpc
from loramux.v1 import adapter_admin_pb2 as pb
from loramux.v1 import adapter_admin_pb2_grpc as pb_grpc

from loramux_core.v1 import engine_pb2
from loramux_services.common import rich_status
from loramux_services.control.manager import AdapterManager, AdminError
from loramux_services.control.registry import AdapterRecord

_DEFAULT_PAGE, _MAX_PAGE = 100, 1000
_MAX_BATCH = 1000  # LoadAdapters items per call
_RESIDENCY_ORDER = {pb.RESIDENCY_DEVICE: 0, pb.RESIDENCY_HOST: 1, pb.RESIDENCY_DISK: 2}


def _admin_call(method):
    """Turn AdminError into the gRPC status it names; count the call and its latency."""
    @functools.wraps(method)
    async def wrapper(self, request, context):
        t0, code = time.monotonic(), "OK"
        try:
            return await method(self, request, context)
        except AdminError as err:
            code = err.code.name
            await rich_status.abort(context, err.code, str(err))
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except Exception:
            code = "UNKNOWN"
            raise
        finally:
            if self.metrics is not None:
                self.metrics.observe_call(method.__name__, code, time.monotonic() - t0)
    return wrapper


def _page_token(name: str) -> str:
    return base64.urlsafe_b64encode(name.encode()).decode()


def _after(token: str) -> str:
    try:
        return base64.urlsafe_b64decode(token.encode()).decode()
    except Exception:  # noqa: BLE001 - any garbage token is the caller's error
        raise AdminError(grpc.StatusCode.INVALID_ARGUMENT, f"page_token {token!r} is invalid") from None


class AdapterAdminServicer(pb_grpc.AdapterAdminServiceServicer):
    def __init__(self, manager: AdapterManager, metrics=None, states=None):
        self.m = manager
        self.metrics = metrics  # services/control/metrics.py ControlMetrics, or None
        self.states = states    # services/control/replica_states.py ReplicaStates, or None
        self._by_name: dict[int, tuple] = {}  # replica -> (its last event, name -> statuses)

    def to_proto(self, rec: AdapterRecord) -> pb.Adapter:
        """Registry record + what each replica last reported about this name: per replica,
        and summed (counts) or the best (residency, its slot) over the replicas."""
        out = pb.Adapter(name=rec.name, path=rec.path, state=rec.state, pinned=rec.pinned,
                         rank=rec.rank, target_modules=rec.target_modules, id=rec.adapter_id,
                         loads=rec.loads, slot=-1)
        placed = set(self.m.placed(rec))
        live = []
        for index, link in enumerate(self.m.links):
            r = out.replicas.add(replica=index, up=link.up, placed=index in placed, slot=-1)
            status = _engine_status(self._statuses(index, link.last_event), rec) \
                if link.up else None
            if status is not None and rec.state != pb.ADAPTER_STATE_REGISTERED:
                r.residency, r.slot, r.id = status.residency, status.slot, status.id
                r.in_flight_requests = status.in_flight_requests
                live.append(status)
        if live:
            best = min(live, key=lambda a: _RESIDENCY_ORDER.get(a.residency, len(_RESIDENCY_ORDER)))
            out.residency, out.slot = best.residency, best.slot
            out.in_flight_requests = sum(a.in_flight_requests for a in live)
            out.evictions = sum(a.evictions for a in live)
            if any(a.loads for a in live):
                out.loads = sum(a.loads for a in live)
        elif rec.state == pb.ADAPTER_STATE_LOADED:
            out.residency = pb.RESIDENCY_DISK
        return out

    def _statuses(self, replica: int, ev: engine_pb2.EngineEvent) -> list:
        """The statuses `ev` lists for each name, indexed once per event: answering a
        batch of a thousand loads must not scan a thousand-adapter event a thousand
        times."""
        have = self._by_name.get(replica)
        if have is None or have[0] is not ev:
            index: dict[str, list] = {}
            for a in ev.adapters:
                index.setdefault(a.name, []).append(a)
            have = self._by_name[replica] = (ev, index)
        return have[1]

    @_admin_call
    async def RegisterAdapter(self, request, context):
        return pb.RegisterAdapterResponse(adapter=self.to_proto(
            await self.m.register(request.name, request.path)))

    @_admin_call
    async def LoadAdapter(self, request, context):
        path = request.path if request.HasField("path") else None
        pinned = request.pinned if request.HasField("pinned") else None
        return pb.LoadAdapterResponse(adapter=self.to_proto(
            await self.m.load(request.name, path, pinned, list(request.replicas))))

    @_admin_call
    async def LoadAdapters(self, request, context):
        if len(request.items) > _MAX_BATCH:
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"{len(request.items)} items: at most {_MAX_BATCH} per LoadAdapters")
        items = [(it.name, it.path if it.HasField("path") else None,
                  it.pinned if it.HasField("pinned") else None, list(it.replicas))
                 for it in request.items]
        resp = pb.LoadAdaptersResponse()
        for result in await self.m.load_many(items):
            if isinstance(result, AdminError):
                resp.results.add(code=result.code.value[0], message=str(result))
            else:
                resp.results.add(adapter=self.to_proto(result))
        return resp

    @_admin_call
    async def UnloadAdapter(self, request, context):
        return pb.UnloadAdapterResponse(adapter=self.to_proto(await self.m.unload(request.name)))

    @_admin_call
    async def UnregisterAdapter(self, request, context):
        await self.m.unregister(request.name)
        return pb.UnregisterAdapterResponse()

    @_admin_call
    async def PinAdapter(self, request, context):
        return pb.PinAdapterResponse(adapter=self.to_proto(await self.m.set_pinned(request.name, True)))

    @_admin_call
    async def UnpinAdapter(self, request, context):
        return pb.UnpinAdapterResponse(adapter=self.to_proto(await self.m.set_pinned(request.name, False)))

    @_admin_call
    async def GetAdapter(self, request, context):
        return pb.GetAdapterResponse(adapter=self.to_proto(self.m.require(request.name)))

    @_admin_call
    async def ListAdapters(self, request, context):
        if request.page_size < 0:
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"page_size={request.page_size}: must be >= 0")
        size = min(request.page_size or _DEFAULT_PAGE, _MAX_PAGE)
        after = _after(request.page_token) if request.page_token else ""
        recs = self.m.registry.page(after, size + 1)
        resp = pb.ListAdaptersResponse(adapters=[self.to_proto(r) for r in recs[:size]])
        if len(recs) > size:
            resp.next_page_token = _page_token(recs[size - 1].name)
        return resp

    @_admin_call
    async def GetStatus(self, request, context):
        if self.states is None:
            raise AdminError(grpc.StatusCode.UNIMPLEMENTED, "replica states are not tracked here")
        return pb.GetStatusResponse(replicas=self.states.status())


def _engine_status(by_name: dict, rec: AdapterRecord) -> engine_pb2.AdapterStatus | None:
    """The engine's entry for this record's id; else its newest version of the name
    (`by_name`: an event's statuses by name, AdapterAdminServicer._statuses)."""
    same_name = by_name.get(rec.name, ())
    for a in same_name:
        if a.id == rec.adapter_id:
            return a
    return max(same_name, key=lambda a: a.id, default=None)
