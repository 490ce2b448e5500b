"""A listening address a service could not bind, said in one line that names the flag
that set it ("--http-port: cannot listen on 127.0.0.1:8000: Address already in use ..."), instead of a traceback
ending in "Address already in use" that names neither."""
from __future__ import annotations

import contextlib
import errno


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


@contextlib.contextmanager
def bind_flag(flag: str, address: str):
    """Raise BindError naming `flag` and `address` for a bind that fails inside."""
    try:
        yield
    except (OSError, RuntimeError) as err:  # grpc raises RuntimeError for a taken port
        raise BindError(flag, address, _reason(err)) from None
