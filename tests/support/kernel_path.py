"""The LoRA kernel path (the one CUDA takes) on the CPU: loramux_kernels.lora sends CPU tensors to
the torch references; inside `lora_kernel_path()` it sends them to the Triton kernels,
which run in Triton's interpreter there (tests/conftest.py sets TRITON_INTERPRET).
The launches of the slot-indexed ops are counted, so a test can tell that the kernels
ran, not only that the result was right. Triton's interpreter keeps the running
program's grid position in shared state: two threads (tensor-parallel ranks as threads,
tests/support/ranks.py) take turns per launch there."""
from __future__ import annotations

import contextlib
import threading
from collections import Counter

import pytest
import torch

OPS = ("scale_rows", "add_embedding_lora")


@contextlib.contextmanager
def lora_kernel_path():
    """loramux_kernels.lora dispatches every tensor (CPU ones too) to the Triton kernels; yields a
    Counter of the slot-indexed ops' launches by name (OPS), of add_lora's and of
    expand_after's (a group whose shrink ran fused into the op before it: CUDA decode
    steps, engine/lora/batch.py FUSED_NORM_SHRINK)."""
    from loramux_kernels import lora
    from loramux_kernels.lora import launch, slot_rows
    assert lora._launch is not None, "Triton is not installed"
    calls: Counter = Counter()

    def counted(name, inner):
        def run(*args, **kwargs):
            calls[name] += 1
            return inner(*args, **kwargs)
        return run
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lora, "_on_triton", lambda t: True)
        for name in OPS:
            mp.setattr(slot_rows, name, counted(name, getattr(slot_rows, name)))
        for name in ("add_lora", "expand_after"):
            mp.setattr(launch, name, counted(name, getattr(launch, name)))
        if not torch.cuda.is_available():
            _one_launch_at_a_time(mp)
        yield calls


def _one_launch_at_a_time(mp) -> None:
    from triton.runtime.interpreter import InterpretedFunction
    lock, run = threading.Lock(), InterpretedFunction.run

    def locked(self, *args, **kwargs):
        with lock:
            return run(self, *args, **kwargs)
    mp.setattr(InterpretedFunction, "run", locked)


def count_fused_shrinks(monkeypatch, source) -> list[int]:
    """loramux_kernels.lora's norm_shrink_ahead and silu_shrink_ahead replaced by `source`'s
    (loramux_kernels.lora itself, or loramux_kernels.lora.launch to run the Triton forms where the
    dispatcher returns None), each counting its fused launches (non-None results)."""
    from loramux_kernels import lora as lora_kernels
    calls = [0]

    def counted(inner):
        def run(*args, **kwargs):
            fused = inner(*args, **kwargs)
            calls[0] += fused is not None
            return fused
        return run
    for name in ("norm_shrink_ahead", "silu_shrink_ahead"):
        monkeypatch.setattr(lora_kernels, name, counted(getattr(source, name)))
    return calls
