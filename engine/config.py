"""Engine configuration: one small frozen dataclass; derived values are functions.

Fields left "auto" or None are decided from the model and the machine by
engine/resolve.py (`resolve_config`) before anything is built; the engine keeps the
resolved config (every field concrete) as `Engine.config`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from loramux_core.engine_config import DTYPES, EngineSettings

_TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}


@dataclass(frozen=True)
class EngineConfig(EngineSettings):
    """EngineSettings (loramux_core/engine_config.py: the fields and their rules) and
    the values derived from them with torch."""

    @property
    def torch_dtype(self) -> torch.dtype:
        assert self.dtype in _TORCH_DTYPES, f"dtype {self.dtype!r} not resolved (engine/resolve.py)"
        return _TORCH_DTYPES[self.dtype]

    @property
    def use_async_scheduling(self) -> bool:
        if self.async_scheduling is not None:
            return self.async_scheduling
        assert self.device != "auto", "device not resolved (engine/resolve.py)"
        return torch.device(self.device).type == "cuda"
