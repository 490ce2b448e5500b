"""Package exports imported on first use.

`engine` and `loramux_engine.lora` re-export their torch-heavy classes (Engine, LoRASlotPool, ...)
for callers' convenience; imported eagerly, those would load torch into every process that
imports one of the torch-free modules beside them (engine/lora/host_buffers.py's
callers, a test reading one module); the parts the control plane and the gateway read (the
model registry, the adapter plan) live in loramux_core/ (docs/ARCHITECTURE.md)."""
from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], object]:
    """A module-level __getattr__ for `package`: the first use of `name` imports the module
    `exports[name]` and keeps the value in the package."""
    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)
        return value
    return __getattr__
