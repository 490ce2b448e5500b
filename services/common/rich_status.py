"""gRPC errors with machine-readable details (google.rpc.Status in the trailers, read by
grpcio-status and every gRPC client library): BadRequest field violations for invalid
arguments, RetryInfo for overload and unavailability."""
from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

RETRY_AFTER_S = 1.0
RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


def _packed(message) -> any_pb2.Any:
    out = any_pb2.Any()
    out.Pack(message)
    return out


def rich_status(code: grpc.StatusCode, message: str, *, field: str | None = None,
                retry_after_s: float | None = None) -> grpc.Status:
    """The status for `code`: with a BadRequest naming `field` when the request was
    invalid, and a RetryInfo (default RETRY_AFTER_S) when a retry may succeed."""
    status = status_pb2.Status(code=code.value[0], message=message)
    if field and code == grpc.StatusCode.INVALID_ARGUMENT:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message)
        status.details.append(_packed(error_details_pb2.BadRequest(field_violations=[violation])))
    if code in RETRYABLE:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int((retry_after_s or RETRY_AFTER_S) * 1e9))
        status.details.append(_packed(error_details_pb2.RetryInfo(retry_delay=delay)))
    return rpc_status.to_status(status)


async def abort(context, code: grpc.StatusCode, message: str, *, field: str | None = None) -> None:
    """End the call with the rich status (raises, like context.abort)."""
    await context.abort_with_status(rich_status(code, message, field=field))
