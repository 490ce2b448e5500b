"""A tensor of a safetensors file held in memory (loramux_core/adapter/safetensors_buffer.py
checked its header), viewed in place."""
from __future__ import annotations

import warnings

import torch

from loramux_core.adapter.safetensors_buffer import TensorInfo


def tensor(buf, info: TensorInfo):
    """The tensor `info` describes, as a read-only view into `buf` (copy before writing).
    Only floating dtypes are supported (the planner refuses the others first)."""
    dtype = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
             "F64": torch.float64}[info.dtype]
    if info.start == info.end:
        return torch.empty(info.shape, dtype=dtype)
    view = memoryview(buf)[info.start:info.end]
    with warnings.catch_warnings():  # bytes are immutable: the view is never written
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(view, dtype=dtype)
    return flat.view(info.shape)
