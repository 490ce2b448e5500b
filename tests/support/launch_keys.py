"""Record the Triton kernel variants a piece of code launches, as Triton would key its
compiled binaries: the kernel, its constexpr arguments, and for every other argument the
properties Triton specialises on (an integer equal to 1 or a multiple of 16, unless the
kernel says do_not_specialize for it; a tensor's dtype). Works compiled (CUDA) and interpreted (the CPU), through
each kernel's pre-run hook.

`force_triton(monkeypatch)` routes the model's kernel dispatch (kernels/lora.py, its
rows-per-adapter rule and slot-row ops included, kernels/elementwise.py, the model's
attention call) to
the Triton modules for CPU tensors too, so an engine on the CPU runs the same kernels
(interpreted) as on a GPU."""
from __future__ import annotations

import inspect

import torch

from tests.support.triton_mode import triton_kernels


def _spec(value):
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return ("int", value == 1, value % 16 == 0)
    if isinstance(value, float):
        return "float"
    if isinstance(value, torch.Tensor):   # (alignment: the caching allocator's, always)
        return str(value.dtype)
    return type(value).__name__


class LaunchKeys:
    """`keys`: every (kernel name, specialisation) launched since `install`."""

    def __init__(self):
        self.keys: set[tuple] = set()
        self.recording = True

    def install(self, monkeypatch, *modules, execute: bool = True) -> "LaunchKeys":
        """Record every launch of the kernels of `modules`. execute=False: record only,
        running nothing (outputs stay uninitialised; for following the shapes of whole
        engine steps quickly, not their values)."""
        for module in modules:
            for name, kernel in triton_kernels(module).items():
                record = self._hook(name, kernel)
                if execute:
                    monkeypatch.setattr(kernel, "pre_run_hooks", [*kernel.pre_run_hooks, record])
                else:
                    monkeypatch.setattr(kernel, "run", _recording_run(record), raising=False)
        return self

    def _hook(self, name: str, kernel):
        params = list(inspect.signature(kernel.fn).parameters.values())
        names = [p.name for p in params]
        const = {p.name for p in params if "constexpr" in str(p.annotation)}
        plain = _not_specialized(kernel, names)

        def record(*args, **kwargs):
            if not self.recording:
                return
            values = dict(zip(names, args)) | kwargs
            key = tuple((n, values[n] if n in const else
                         "int" if n in plain and isinstance(values[n], int) else _spec(values[n]))
                        for n in names if n in values)
            self.keys.add((name, key))
        return record


def _not_specialized(kernel, names: list[str]) -> set[str]:
    """The kernel's do_not_specialize arguments (by name), compiled or interpreted: Triton
    keys none of their values."""
    given = getattr(kernel, "do_not_specialize", None)
    if given is None:   # the interpreter keeps the decorator's arguments as they came
        given = getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()
    return {names[a] if isinstance(a, int) else a for a in given}


def _recording_run(record):
    def run(*args, grid=None, warmup=False, **kwargs):
        if not warmup:
            record(*args, **kwargs)
    return run


def force_triton(monkeypatch) -> None:
    import loramux_engine.model.llama as llama
    from loramux_kernels import attention_triton, elementwise, lora
    from loramux_kernels.lora import launch, slot_rows

    monkeypatch.setattr(elementwise, "_gpu", lambda x: True)
    monkeypatch.setattr(lora, "add_lora", launch.add_lora)
    monkeypatch.setattr(lora, "scale_rows", slot_rows.scale_rows)
    monkeypatch.setattr(lora, "add_embedding_lora", slot_rows.add_embedding_lora)
    monkeypatch.setattr(lora, "norm_shrink_ahead", launch.norm_shrink_ahead)
    monkeypatch.setattr(lora, "silu_shrink_ahead", launch.silu_shrink_ahead)

    def build_meta(token_slots, max_loras, uniform=False):   # loramux_kernels.lora's, CPU tensors too
        return launch.build_meta(token_slots, max_loras)
    monkeypatch.setattr(lora, "build_meta", build_meta)
    monkeypatch.setattr(lora, "mixed_min_rows", launch.mixed_min_rows)
    monkeypatch.setattr(llama, "paged_attention",
                        lambda q, k, v, attn, scale, window=None:
                        attention_triton.paged_attention(q, k, v, attn, scale, window=window))
