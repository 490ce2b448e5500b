"""Bearer-token authentication for admin calls (a grpc.aio server interceptor)."""
from __future__ import annotations

import hmac

import grpc

# Health checks and reflection stay open so orchestrators can probe without the token.
_OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


def _deny(message: str) -> grpc.RpcMethodHandler:
    async def abort(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
    return grpc.unary_unary_rpc_method_handler(abort)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every call but health and reflection."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if details.method.startswith(_OPEN_PREFIXES):
            return await continuation(details)
        got = dict(details.invocation_metadata or ()).get("authorization")
        if got is None:
            return _deny("missing 'authorization: Bearer <token>' metadata")
        if not hmac.compare_digest(got.encode(), self._expected):
            return _deny("invalid bearer token")
        return await continuation(details)
