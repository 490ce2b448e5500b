"""The decoder layers that stand for all of them in the warm-up's eager steps.

Every decoder layer of a model runs the same code on tensors of the same shapes, dtypes
and strides (one layer class per model; a sliding window, MoE or not, is the model's,
not a layer's), so the kernel variants one layer launches are those every later layer launches,
but for what Triton also keys a variant on: whether a pointer is 16-byte aligned. The
LoRA buffers of a layer are views into a tensor stacked over the layers
(engine/lora/pool.py), so a layer's alignment can differ from another's when a layer's
slice is not a multiple of 16 bytes: one layer of each alignment pattern is kept.

The first layer is kept apart from the rest: it starts the residual stream, so its input
norm has no residual to add (another variant of the fused add-norm kernels).

An eager step over these layers (and the embedding, final norm and head, which run
once per step whatever the depth) launches every variant the whole model does, at a
fraction of the work: two layers instead of 32 for a Llama-3-8B."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def _aligned(t) -> tuple:
    if isinstance(t, torch.Tensor):
        return (t.data_ptr() % 16 == 0,)
    if isinstance(t, (tuple, list)):
        return tuple(a for x in t for a in _aligned(x))
    return ()


def layer_signature(runner, layer: int) -> tuple:
    """What Triton keys on beyond shapes and dtypes that may differ between layers: the
    16-byte alignment of the layer's KV cache and LoRA buffers."""
    pool = runner.lora_pool
    sig = _aligned(runner.kv_caches[layer])
    for group in getattr(pool, "groups", ()):
        sig += _aligned(pool.weights(layer, group))
    return sig


def representative_layers(runner) -> list[int]:
    """Layer 0, and of the layers after it the first of each distinct signature (usually
    [0, 1]). The first layer differs from the rest: it starts the residual stream, so its
    input norm adds no residual (the fused add-norm kernels' other variant)."""
    seen: dict[tuple, int] = {}
    for layer in range(1, len(runner.kv_caches)):
        seen.setdefault(layer_signature(runner, layer), layer)
    return [0, *sorted(seen.values())]


@contextmanager
def only_layers(runner, layers: list[int]) -> Iterator[None]:
    """Within: the runner's model runs `layers` only (with their KV caches). For the
    warm-up's eager steps alone: nothing else may run meanwhile (graph captures need the
    whole model and come after)."""
    model = runner.model
    full, caches = model.layers, runner.kv_caches
    model.layers = nn.ModuleList(full[i] for i in layers)
    runner.kv_caches = [caches[i] for i in layers]
    try:
        yield
    finally:
        model.layers, runner.kv_caches = full, caches
