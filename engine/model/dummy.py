"""Random weights for `load_format="dummy"`: benchmarks of full-size shapes without weight
files. Every parameter is drawn on its own device from one seeded generator, scaled so
that activations stay finite in bfloat16 through dozens of layers:

    matrices [out, in]   N(0, 1/in)   (unit-variance inputs give unit-variance outputs)
    embeddings           N(0, 1)
    norm weights         1
    biases               0
    FP8 matrices         N(0, 1) in float8_e4m3fn, row scales 1/sqrt(in)  (the same law)
"""
from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Overwrite every parameter of `model` (in place, on its device) with seeded noise."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        gen = gens.get(p.device)
        if gen is None:
            gen = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        if p.dtype == torch.float8_e4m3fn:
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device))
        elif name.endswith("weight_scale"):   # the rows of an FP8 matrix [out, in]
            weight = model.get_parameter(name.removesuffix("_scale"))
            p.fill_(weight.shape[-1] ** -0.5)
        elif name.endswith("bias"):
            p.zero_()
        elif p.dim() == 1:              # RMSNorm scales
            p.fill_(1.0)
        elif "embed_tokens" in name:
            p.normal_(0.0, 1.0, generator=gen)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
