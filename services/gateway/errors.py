"""Rejected: a Generate call refused with a precise gRPC status and message; BadParam: an
HTTP request field that cannot be served."""
from __future__ import annotations

import re

import grpc

from loramux_services.common.messages import bounded


class Rejected(Exception):
    """`field`: the request field at fault (INVALID_ARGUMENT), as in a BadRequest field
    violation ("sampling.temperature", "messages.messages[0].role", ...)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None):
        super().__init__(bounded(message))
        self.code = code
        self.field = field

    @classmethod
    def from_wire(cls, code: int, message: str) -> "Rejected":
        """From an ErrorCode carried in an engine message (the gRPC code numbers). The
        gateway sends only adapters its table has LOADED, so an engine that does not
        hold one (NOT_FOUND there) means a known name in the wrong state here."""
        if code == grpc.StatusCode.NOT_FOUND.value[0]:
            return cls(grpc.StatusCode.FAILED_PRECONDITION, message)
        for c in grpc.StatusCode:
            if c.value[0] == code:
                return cls(c, message, sampling_field(message)
                           if c == grpc.StatusCode.INVALID_ARGUMENT else None)
        return cls(grpc.StatusCode.INTERNAL, message)


_SAMPLING_FIELD = re.compile(r"sampling(?:\.[A-Za-z_]+)+")


def sampling_field(message: str) -> str | None:
    """The field an InvalidRequestError about sampling names first ("sampling.top_p=2:
    ...", "sampling.structured.regex: ..."); None when it names none."""
    found = _SAMPLING_FIELD.match(message)
    return found.group() if found else None


class BadParam(ValueError):
    """An HTTP request field that cannot be served: 400 with `param` named."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param
