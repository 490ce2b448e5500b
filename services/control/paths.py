"""Adapter names, and where adapters may be read from.

The path policy is one module shared with the engines (loramux_core/safe_files.py), so the
control plane and the engines refuse exactly the same paths: every adapter directory lies
below a configured root, reached without following any link; a refusal is PathRefused (gRPC
PERMISSION_DENIED) and names the path only as given."""
from __future__ import annotations

import re

from loramux_core.errors import AdapterPathError as PathRefused
from loramux_core.safe_files import AdapterRoots

__all__ = ["AdapterRoots", "PathRefused", "check_name"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_name(name: str) -> str | None:
    """Why `name` is not a valid adapter name, or None if it is."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return (f"adapter name {name!r} is invalid: 1-128 characters from [A-Za-z0-9._-], "
                "starting with a letter or digit")
    return None
