"""A listening address a service could not bind, said in one line that names the flag
that set it ("--http-port: cannot listen on 127.0.0.1:8000: Address already in use ..."), instead of a traceback
ending in "Address already in use" that names neither."""
from __future__ import annotations

import contextlib
import errno
import socket

import zmq


class BindError(Exception):
    """`flag`'s address could not be bound; str() is the one line to print."""

    def __init__(self, flag: str, address: str, reason: str):
        super().__init__(f"{flag}: cannot listen on {address}: {reason}")
        self.flag, self.address = flag, address


def _reason(err: BaseException) -> str:
    if isinstance(err, OSError) and err.errno == errno.EADDRINUSE:
        return "Address already in use (another process listens on it)"
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return str(err) or type(err).__name__


def _probe(address: str) -> OSError | None:
    """Why `address` ("host:port", "tcp://host:port") cannot be bound now, found by binding
    it as the servers do (gRPC only says "Failed to bind")."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, int(port)))
    except OSError as err:
        return err
    except ValueError:  # not host:port (a ZMQ ipc:// address): nothing to probe
        return None
    return None


@contextlib.contextmanager
def bind_flag(flag: str, address: str):
    """Raise BindError naming `flag` and `address` for a bind that fails inside."""
    try:
        yield
    except (OSError, RuntimeError, zmq.ZMQError) as err:  # gRPC: RuntimeError
        raise BindError(flag, address, _reason(
            err if isinstance(err, OSError) else _probe(address) or err)) from None
