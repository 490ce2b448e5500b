"""Channels with the SDK's retry policy (a gRPC service config), and the rich error details
(google.rpc.Status) a loramux server attaches to a failed call.

Retried, with exponential backoff, only where a retry cannot repeat work the caller saw:
Generate on RESOURCE_EXHAUSTED (the gateway's admission limit) and UNAVAILABLE, which gRPC
retries only until the first response arrives (a stream that already produced tokens is
never replayed); the admin service's reads (GetAdapter, ListAdapters) on UNAVAILABLE."""
from __future__ import annotations

import json

import grpc
from google.rpc import error_details_pb2, status_pb2

_BACKOFF = {"maxAttempts": 5, "initialBackoff": "0.1s", "maxBackoff": "2s",
            "backoffMultiplier": 2}
SERVICE_CONFIG = {"methodConfig": [
    {"name": [{"service": "loramux.v1.GenerateService", "method": "Generate"}],
     "retryPolicy": {**_BACKOFF, "retryableStatusCodes": ["RESOURCE_EXHAUSTED", "UNAVAILABLE"]}},
    {"name": [{"service": "loramux.v1.AdapterAdminService", "method": m}
              for m in ("GetAdapter", "ListAdapters")],
     "retryPolicy": {**_BACKOFF, "retryableStatusCodes": ["UNAVAILABLE"]}},
]}


def channel_options(retry: bool) -> list[tuple[str, object]]:
    if not retry:
        return [("grpc.enable_retries", 0)]
    return [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(SERVICE_CONFIG))]


def channel(target: str, tls=None, retry: bool = True) -> grpc.Channel:
    """A channel to `target` with the retry policy; TLS when `tls` (loramux.TLS) is given."""
    options = channel_options(retry)
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, tls.credentials(), options=tls.options() + options)


def aio_channel(target: str, tls=None, retry: bool = True) -> grpc.aio.Channel:
    options = channel_options(retry)
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, tls.credentials(), options=tls.options() + options)


def status_details(err: grpc.RpcError) -> tuple[list[tuple[str, str]], float | None]:
    """(BadRequest field violations as (field, description), RetryInfo delay in seconds)
    from a failed call's trailers; ([], None) when it carries none."""
    trailers = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    raw = next((v for k, v in (trailers or ()) if k == "grpc-status-details-bin"), None)
    if not raw:
        return [], None
    violations, delay = [], None
    for detail in status_pb2.Status.FromString(raw).details:
        bad, retry = error_details_pb2.BadRequest(), error_details_pb2.RetryInfo()
        if detail.Unpack(bad):
            violations += [(v.field, v.description) for v in bad.field_violations]
        elif detail.Unpack(retry):
            delay = retry.retry_delay.ToNanoseconds() / 1e9
    return violations, delay
