"""Synchronous clients: GenerateClient (streaming text generation) and AdminClient."""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import grpc

from loramux import tls as _tls
from loramux._channel import channel as open_channel
from loramux._channel import status_details
from loramux._request import (LoadResult, auth_metadata, chat_request, generate_request,
                              load_many_request, load_request, load_results)
from loramux.v1 import adapter_admin_pb2 as admin_pb2
from loramux.v1 import adapter_admin_pb2_grpc as admin_grpc
from loramux.v1 import generate_pb2, generate_pb2_grpc


class LoramuxError(Exception):
    """A call failed: `code` is the grpc.StatusCode, `details` the server's message;
    `field_violations` lists (field, description) for an invalid request, `retry_delay`
    the seconds the server asks to wait before a retry (None if it names none)."""

    def __init__(self, code: grpc.StatusCode, details: str, *,
                 field_violations: list[tuple[str, str]] | None = None,
                 retry_delay: float | None = None):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.field_violations = field_violations or []
        self.retry_delay = retry_delay

    @classmethod
    def from_rpc(cls, err: grpc.RpcError) -> "LoramuxError":
        violations, delay = status_details(err)
        return cls(err.code(), err.details() or "", field_violations=violations,
                   retry_delay=delay)


class GenerateClient:
    """Streams generations from a loramux gateway (`target` is "host:port"; `tls` for a
    gateway started with --tls-cert). Calls the gateway refuses for overload or
    unavailability are retried (loramux._channel); retry=False turns that off."""

    def __init__(self, target: str, *, tls: _tls.TLS | None = None,
                 channel: grpc.Channel | None = None, retry: bool = True):
        self._channel = channel or open_channel(target, tls, retry)
        self._stub = generate_pb2_grpc.GenerateServiceStub(self._channel)

    def stream(self, prompt: str | Sequence[int], adapter: str | None = None, *,
               timeout: float | None = None, request_id: str = "",
               **sampling) -> Iterator[generate_pb2.GenerateResponse]:
        """Yield one GenerateResponse per engine step; the last has finish_reason set.
        Closing the iterator early cancels the request in the engine. `sampling`: the
        SamplingParams fields, and at most one output constraint: json_schema= (a dict or
        its JSON text), json_object=True, regex=, choice=[...], grammar= (Lark text)."""
        return self._stream(generate_request(prompt, adapter, request_id, **sampling), timeout)

    def chat_stream(self, messages: Sequence[Mapping[str, str]], adapter: str | None = None, *,
                    timeout: float | None = None, request_id: str = "",
                    add_generation_prompt: bool | None = None,
                    continue_final_message: bool = False,
                    **sampling) -> Iterator[generate_pb2.GenerateResponse]:
        """Like stream(), with the prompt made from chat `messages` (OpenAI's message
        dicts) by the served model's chat template (the adapter's own when it has one);
        tools=[...] (OpenAI function tools) are rendered by the template too, and
        tool_choice= / parallel_tool_calls= decide the calls (chat_request)."""
        req = chat_request(messages, adapter, request_id,
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, **sampling)
        return self._stream(req, timeout)

    def chat(self, messages: Sequence[Mapping[str, str]], adapter: str | None = None, *,
             timeout: float | None = None, **kwargs) -> "Completion":
        """Run one chat request to completion (the assistant's reply in .text, the calls
        of its tools parsed in .tool_calls)."""
        return Completion.collect(self.chat_stream(messages, adapter, timeout=timeout, **kwargs))

    def _stream(self, req: generate_pb2.GenerateRequest,
                timeout: float | None) -> Iterator[generate_pb2.GenerateResponse]:
        call = self._stub.Generate(req, timeout=timeout)
        try:
            yield from call
        except grpc.RpcError as err:
            raise LoramuxError.from_rpc(err) from None
        finally:
            call.cancel()

    def generate(self, prompt: str | Sequence[int], adapter: str | None = None, *,
                 timeout: float | None = None, **sampling) -> "Completion":
        """Run one request to completion and return its text, tokens and finish reason."""
        return Completion.collect(self.stream(prompt, adapter, timeout=timeout, **sampling))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Completion:
    """The whole output of one Generate stream."""

    def __init__(self):
        self._pieces: list[str] = []  # `text += piece` would copy all of it per response
        self.token_ids: list[int] = []
        self.finish_reason = "unspecified"
        self.usage = generate_pb2.Usage()
        self.timings = generate_pb2.Timings()
        self.tool_calls: list[generate_pb2.ToolCall] = []  # id, name, arguments (JSON text)
        self.responses = 0

    @property
    def text(self) -> str:
        """The text generated so far."""
        return "".join(self._pieces)

    def add(self, resp: generate_pb2.GenerateResponse) -> None:
        if resp.text:
            self._pieces.append(resp.text)
        self.token_ids.extend(resp.token_ids)
        self.responses += 1
        if resp.finish_reason:
            name = generate_pb2.FinishReason.Name(resp.finish_reason)
            self.finish_reason = name.removeprefix("FINISH_REASON_").lower()
            self.usage.CopyFrom(resp.usage)
            self.timings.CopyFrom(resp.timings)
            self.tool_calls = list(resp.tool_calls)

    @classmethod
    def collect(cls, responses) -> "Completion":
        out = cls()
        for resp in responses:
            out.add(resp)
        return out


class AdminClient:
    """Manages adapters on a loramux control plane (`target` is "host:port"; `tls` for a
    control plane started with --tls-cert); reads are retried while the control plane is
    unavailable (retry=False: never)."""

    def __init__(self, target: str, *, token: str | None = None, tls: _tls.TLS | None = None,
                 channel: grpc.Channel | None = None, timeout: float | None = 60.0,
                 retry: bool = True):
        self._channel = channel or open_channel(target, tls, retry)
        self._stub = admin_grpc.AdapterAdminServiceStub(self._channel)
        self._metadata = auth_metadata(token)
        self._timeout = timeout

    def _call(self, method: str, request):
        try:
            return getattr(self._stub, method)(request, metadata=self._metadata,
                                               timeout=self._timeout)
        except grpc.RpcError as err:
            raise LoramuxError.from_rpc(err) from None

    def register(self, name: str, path: str) -> admin_pb2.Adapter:
        return self._call("RegisterAdapter",
                          admin_pb2.RegisterAdapterRequest(name=name, path=path)).adapter

    def load(self, name: str, path: str | None = None, *,
             pinned: bool | None = None, replicas=None) -> admin_pb2.Adapter:
        """Load `name` (registering it from `path` first); `pinned` None keeps its pin;
        `replicas`: the engine replicas (indexes) to place it on, None: every one (or the
        placement it has)."""
        return self._call("LoadAdapter", load_request(name, path, pinned, replicas)).adapter

    def load_many(self, items) -> list[LoadResult]:
        """Load many adapters in one LoadAdapters call: `items` are (name, path) pairs or
        mappings of load()'s arguments (at most 1000). Each item gets its own LoadResult,
        in order: one refused adapter fails no other."""
        req = load_many_request(items)
        return load_results(req, self._call("LoadAdapters", req))

    def unload(self, name: str) -> admin_pb2.Adapter:
        return self._call("UnloadAdapter", admin_pb2.UnloadAdapterRequest(name=name)).adapter

    def unregister(self, name: str) -> None:
        self._call("UnregisterAdapter", admin_pb2.UnregisterAdapterRequest(name=name))

    def pin(self, name: str) -> admin_pb2.Adapter:
        return self._call("PinAdapter", admin_pb2.PinAdapterRequest(name=name)).adapter

    def unpin(self, name: str) -> admin_pb2.Adapter:
        return self._call("UnpinAdapter", admin_pb2.UnpinAdapterRequest(name=name)).adapter

    def get(self, name: str) -> admin_pb2.Adapter:
        return self._call("GetAdapter", admin_pb2.GetAdapterRequest(name=name)).adapter

    def status(self) -> list[admin_pb2.ReplicaStatus]:
        """Every engine replica's state (starting, warming up, serving, restarting, failed)."""
        return list(self._call("GetStatus", admin_pb2.GetStatusRequest()).replicas)

    def list(self, page_size: int = 0) -> list[admin_pb2.Adapter]:
        """Every adapter, following the pages."""
        out, token = [], ""
        while True:
            resp = self._call("ListAdapters", admin_pb2.ListAdaptersRequest(
                page_size=page_size, page_token=token))
            out.extend(resp.adapters)
            token = resp.next_page_token
            if not token:
                return out

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
