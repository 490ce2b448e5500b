"""Serving the HTTP API with uvicorn inside the gateway's event loop, behind a guard that
checks the bearer token and caps the request body.

uvicorn runs on a socket bound here (so port 0 works and the bound port is known before
start) and never installs signal handlers: the gateway's own handlers stop everything."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import socket

import uvicorn

from loramux_services.gateway.http_api import error_body


class BodyTooLarge(Exception):
    pass


class Guard:
    """ASGI middleware: 401 without the bearer token (when one is set) on /v1/*, 413 for a
    body over `max_body_bytes` (by Content-Length, or counted as it streams in)."""

    def __init__(self, app, *, token: str | None, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes
        self._expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self._expected and scope["path"].startswith("/v1/") and not hmac.compare_digest(
                headers.get(b"authorization", b""), self._expected):
            return await _reply(send, 401, "a valid bearer token is required "
                                "(Authorization: Bearer <token>)")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _reply(send, 413, f"the request body has {int(length)} bytes; "
                                f"at most {self.max_body_bytes}")
        seen, started = 0, False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                raise BodyTooLarge()
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await _reply(send, 413, f"the request body is over {self.max_body_bytes} bytes")


async def _reply(send, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _Server(uvicorn.Server):
    def capture_signals(self):  # the gateway owns SIGINT/SIGTERM
        return contextlib.nullcontext()


class HttpServer:
    def __init__(self, app, host: str, port: int, *, token: str | None, max_body_bytes: int,
                 tls=None):
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(Guard(app, token=token, max_body_bytes=max_body_bytes),
                                log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=None,
                                **(tls.uvicorn_options() if tls is not None else {}))
        self._server = _Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it failed
            await asyncio.sleep(0.01)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let open requests finish for up to `grace_s`, then close."""
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), grace_s)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
        self._sock.close()
