"""Error messages that cross the wire: bounded, whatever user strings they quote (a gRPC
status message travels in metadata, which peers cap at 8 KiB by default)."""
from __future__ import annotations

MAX_MESSAGE = 1024  # characters


def bounded(message: str, limit: int = MAX_MESSAGE) -> str:
    """`message` cut to at most `limit` characters, saying how much was cut."""
    if len(message) <= limit:
        return message
    kept = limit - len(f"... ({len(message)} characters cut)")
    return f"{message[:kept]}... ({len(message) - kept} characters cut)"
