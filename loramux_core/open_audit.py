"""A test-only record of every file a service process opens (Python audit hook on "open").

With LORAMUX_TEST_OPEN_AUDIT=<prefix> in its environment, a service process appends one
JSON line `[path, flags]` per open to `<prefix>.<process>.<pid>`: builtins.open and os.open
both raise the "open" audit event before the system call, with the path as passed (relative
to a directory handle for loramux_core/safe_files.py, whose opens carry O_NOFOLLOW).
tests/test_hostile_adapters.py reads these files to show that no open names a path outside
the adapter roots. Unset (always, outside tests), nothing is installed.
"""
from __future__ import annotations

import json
import os
import sys

ENV = "LORAMUX_TEST_OPEN_AUDIT"


def install_from_env(process: str) -> None:
    prefix = os.environ.get(ENV)
    if not prefix:
        return
    log = open(f"{prefix}.{process}.{os.getpid()}", "a", buffering=1, encoding="utf-8")

    def hook(event: str, args: tuple) -> None:
        if event != "open" or not args or isinstance(args[0], int):
            return
        path = args[0]
        path = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path)
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else None
        log.write(json.dumps([path, flags]) + "\n")
    sys.addaudithook(hook)
