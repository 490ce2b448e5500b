"""Building and running a grpc.aio server with health, reflection and graceful shutdown."""
from __future__ import annotations

import asyncio
import json
import os
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


def make_server(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                interceptors=()) -> grpc.aio.Server:
    """A grpc.aio server whose messages in and out are capped at `max_message_bytes`
    (a bigger request gets RESOURCE_EXHAUSTED from grpc itself)."""
    return grpc.aio.server(interceptors=list(interceptors), options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ])


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]):
    """Register grpc.health.v1 (every service starts NOT_SERVING) and reflection."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME], server)
    return servicer


# A health "service" that is SERVING from start to the graceful shutdown, whatever the
# server's readiness: for liveness probes (an orchestrator restarts a process that stops
# answering it, not one that waits for its engines).
LIVENESS = "liveness"


async def mark_alive(servicer) -> None:
    await servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)


async def set_serving(servicer, service_names: list[str], serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ["", *service_names]:
        await servicer.set(name, status)


def bind(server: grpc.aio.Server, address: str, tls=None) -> str:
    """Bind `address` ("host:port"; port 0 picks a free one), with TLS when `tls` (a
    loramux_services.common.tls.ServerTLS) is given; returns the bound address."""
    host = address.rsplit(":", 1)[0]
    port = (server.add_secure_port(address, tls.credentials()) if tls is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise OSError(f"cannot bind gRPC address {address}")
    return f"{host}:{port}"


def write_ready_file(path: str | None, info: dict) -> None:
    """Atomically write `info` as JSON (tests and the launcher wait for this file)."""
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
