"""asyncio clients (grpc.aio): AsyncGenerateClient and AsyncAdminClient."""
from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence

import grpc

from loramux import tls as _tls
from loramux._channel import aio_channel
from loramux._request import (LoadResult, auth_metadata, chat_request, generate_request,
                              load_many_request, load_request, load_results)
from loramux.client import Completion, LoramuxError
from loramux.v1 import adapter_admin_pb2 as admin_pb2
from loramux.v1 import adapter_admin_pb2_grpc as admin_grpc
from loramux.v1 import generate_pb2, generate_pb2_grpc


class AsyncGenerateClient:
    """asyncio twin of loramux.client.GenerateClient."""

    def __init__(self, target: str, *, tls: _tls.TLS | None = None,
                 channel: grpc.aio.Channel | None = None, retry: bool = True):
        self._channel = channel or aio_channel(target, tls, retry)
        self._stub = generate_pb2_grpc.GenerateServiceStub(self._channel)

    async def stream(self, prompt: str | Sequence[int], adapter: str | None = None, *,
                     timeout: float | None = None, request_id: str = "",
                     **sampling) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Yield one GenerateResponse per engine step; leaving early cancels the request."""
        req = generate_request(prompt, adapter, request_id, **sampling)
        async for resp in self._stream(req, timeout):
            yield resp

    async def chat_stream(self, messages: Sequence[Mapping[str, str]], adapter: str | None = None,
                          *, timeout: float | None = None, request_id: str = "",
                          add_generation_prompt: bool | None = None,
                          continue_final_message: bool = False,
                          **sampling) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Like stream(), with the prompt made from chat `messages` by the chat template
        (tools=[...] as in GenerateClient.chat_stream)."""
        req = chat_request(messages, adapter, request_id,
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, **sampling)
        async for resp in self._stream(req, timeout):
            yield resp

    async def chat(self, messages: Sequence[Mapping[str, str]], adapter: str | None = None, *,
                   timeout: float | None = None, **kwargs) -> Completion:
        out = Completion()
        async for resp in self.chat_stream(messages, adapter, timeout=timeout, **kwargs):
            out.add(resp)
        return out

    async def _stream(self, req: generate_pb2.GenerateRequest,
                      timeout: float | None) -> AsyncIterator[generate_pb2.GenerateResponse]:
        call = self._stub.Generate(req, timeout=timeout)
        try:
            async for resp in call:
                yield resp
        except grpc.RpcError as err:
            raise LoramuxError.from_rpc(err) from None
        finally:
            call.cancel()

    async def generate(self, prompt: str | Sequence[int], adapter: str | None = None, *,
                       timeout: float | None = None, **sampling) -> Completion:
        out = Completion()
        async for resp in self.stream(prompt, adapter, timeout=timeout, **sampling):
            out.add(resp)
        return out

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


class AsyncAdminClient:
    """asyncio twin of loramux.client.AdminClient."""

    def __init__(self, target: str, *, token: str | None = None, tls: _tls.TLS | None = None,
                 channel: grpc.aio.Channel | None = None, timeout: float | None = 60.0,
                 retry: bool = True):
        self._channel = channel or aio_channel(target, tls, retry)
        self._stub = admin_grpc.AdapterAdminServiceStub(self._channel)
        self._metadata = auth_metadata(token)
        self._timeout = timeout

    async def _call(self, method: str, request):
        try:
            return await getattr(self._stub, method)(request, metadata=self._metadata,
                                                     timeout=self._timeout)
        except grpc.RpcError as err:
            raise LoramuxError.from_rpc(err) from None

    async def register(self, name: str, path: str) -> admin_pb2.Adapter:
        return (await self._call("RegisterAdapter",
                                 admin_pb2.RegisterAdapterRequest(name=name, path=path))).adapter

    async def load(self, name: str, path: str | None = None, *,
                   pinned: bool | None = None, replicas=None) -> admin_pb2.Adapter:
        """Load `name` (registering it from `path` first); `pinned` None keeps its pin;
        `replicas`: the engine replicas (indexes) to place it on, None: every one (or the
        placement it has)."""
        return (await self._call("LoadAdapter", load_request(name, path, pinned, replicas))).adapter

    async def load_many(self, items) -> list[LoadResult]:
        """Load many adapters in one LoadAdapters call: `items` are (name, path) pairs or
        mappings of load()'s arguments (at most 1000). Each item gets its own LoadResult,
        in order: one refused adapter fails no other."""
        req = load_many_request(items)
        return load_results(req, await self._call("LoadAdapters", req))

    async def unload(self, name: str) -> admin_pb2.Adapter:
        return (await self._call("UnloadAdapter", admin_pb2.UnloadAdapterRequest(name=name))).adapter

    async def unregister(self, name: str) -> None:
        await self._call("UnregisterAdapter", admin_pb2.UnregisterAdapterRequest(name=name))

    async def pin(self, name: str) -> admin_pb2.Adapter:
        return (await self._call("PinAdapter", admin_pb2.PinAdapterRequest(name=name))).adapter

    async def unpin(self, name: str) -> admin_pb2.Adapter:
        return (await self._call("UnpinAdapter", admin_pb2.UnpinAdapterRequest(name=name))).adapter

    async def get(self, name: str) -> admin_pb2.Adapter:
        return (await self._call("GetAdapter", admin_pb2.GetAdapterRequest(name=name))).adapter

    async def status(self) -> list[admin_pb2.ReplicaStatus]:
        return list((await self._call("GetStatus", admin_pb2.GetStatusRequest())).replicas)

    async def list(self, page_size: int = 0) -> list[admin_pb2.Adapter]:
        out, token = [], ""
        while True:
            resp = await self._call("ListAdapters", admin_pb2.ListAdaptersRequest(
                page_size=page_size, page_token=token))
            out.extend(resp.adapters)
            token = resp.next_page_token
            if not token:
                return out

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
