"""Which way a kernel module's Triton kernels run: compiled (CUDA) or in Triton's
interpreter (the CPU). tests/conftest.py sets TRITON_INTERPRET before any kernel module is
imported when there is no CUDA; the kernel tests check here that it took effect, so on
the CPU they exercise the Triton kernels themselves and not only the torch references."""
from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


def triton_kernels(module) -> dict[str, object]:
    """Every Triton kernel (decorated function) defined in `module`, by name."""
    return {name: v for name, v in vars(module).items()
            if isinstance(v, (JITFunction, InterpretedFunction))}


def check_kernel_mode(module) -> None:
    """Fails unless `module` has kernels and all of them run the way this machine needs:
    interpreted without CUDA, compiled with it."""
    kernels = triton_kernels(module)
    assert kernels, f"{module.__name__} defines no Triton kernels"
    want = JITFunction if torch.cuda.is_available() else InterpretedFunction
    wrong = sorted(name for name, k in kernels.items() if not isinstance(k, want))
    assert not wrong, (f"{module.__name__}: kernels {wrong} are not {want.__name__} "
                       f"(was the kernel module imported before TRITON_INTERPRET was set?)")
