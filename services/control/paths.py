"""Adapter path policy: every adapter directory must resolve inside a configured root.

Refused: any `..` component, absolute paths outside the roots, and symlinks (anywhere in
the path) whose target leaves the roots, since the check is made on the realpath."""
from __future__ import annotations

import os
import re
from pathlib import PurePath

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class PathRefused(ValueError):
    """The path is outside the adapter roots (gRPC PERMISSION_DENIED)."""


def check_name(name: str) -> str | None:
    """Why `name` is not a valid adapter name, or None if it is."""
    if not _NAME.match(name or ""):
        return (f"adapter name {name!r} is invalid: 1-128 characters from [A-Za-z0-9._-], "
                "starting with a letter or digit")
    return None


class AdapterRoots:
    """The directories adapters may be loaded from."""

    def __init__(self, roots: list[str]):
        if not roots:
            raise ValueError("at least one adapter root is required")
        self.roots = [os.path.realpath(r) for r in roots]

    def resolve(self, path: str) -> str:
        """The realpath of `path` (relative paths are taken from the first root), or
        PathRefused saying why it is not allowed."""
        if not path:
            raise PathRefused("adapter path is empty")
        if ".." in PurePath(path).parts:
            raise PathRefused(f"adapter path {path!r} contains '..'")
        joined = path if os.path.isabs(path) else os.path.join(self.roots[0], path)
        real = os.path.realpath(joined)
        for root in self.roots:
            if os.path.commonpath([root, real]) == root:
                return real
        raise PathRefused(f"adapter path {path!r} resolves to {real!r}, outside the adapter "
                          f"roots {self.roots}")
