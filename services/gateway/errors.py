"""Rejected: a Generate call refused with a precise gRPC status and message."""
from __future__ import annotations

import grpc


class Rejected(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code

    @classmethod
    def from_wire(cls, code: int, message: str) -> "Rejected":
        """From an ErrorCode carried in an engine message (the gRPC code numbers)."""
        for c in grpc.StatusCode:
            if c.value[0] == code:
                return cls(c, message)
        return cls(grpc.StatusCode.INTERNAL, message)
