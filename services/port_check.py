"""The ports `loramux serve`'s configuration fixes, checked before anything slow (the demo
model, the engine's warm-up): a taken one stops it at once with one line naming the flag,
not minutes later as a traceback of the process that could not bind it."""
from __future__ import annotations

import errno
import socket


def fixed_ports(args) -> list[tuple[str, int]]:
    """(flag, port) for every port the parsed `loramux serve` arguments fix (0: picked
    later, -1: off; neither is checked)."""
    ports = [("--gateway-port", args.gateway_port), ("--control-port", args.control_port),
             ("--http-port", args.http_port), ("--metrics-port", args.metrics_port)]
    return [(flag, port) for flag, port in ports if port > 0]


def _listening(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.settimeout(0.5)
        return s.connect_ex((host if host not in ("0.0.0.0", "::") else "localhost", port)) == 0


def _bindable(host: str, port: int) -> OSError | None:
    """None when `host:port` can be bound now, as the services bind it (SO_REUSEADDR: a
    port with connections still in TIME_WAIT is free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            return err
    return None


def port_problem(host: str, ports: list[tuple[str, int]]) -> str | None:
    """The first problem of the fixed `ports` on `host`, as one line, or None."""
    seen: dict[int, str] = {}
    for flag, port in ports:
        if port in seen:
            return f"{flag} {port} is also {seen[port]}'s port: give each its own"
        seen[port] = flag
        err = _bindable(host, port)
        if err is None:
            continue
        where = f"{host}:{port}"
        if _listening(host, port):
            return f"{flag} {port} is already in use (another process is listening on {where})"
        if err.errno == errno.EADDRINUSE:
            return f"{flag} {port} is already in use (another process has bound {where})"
        return f"{flag} {port} cannot be bound on {host}: {err.strerror or err}"
    return None
