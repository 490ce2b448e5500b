"""Mixture-of-experts MLP over routed tokens, with per-token expert LoRA: the Triton
grouped GEMM on CUDA (kernels/moe_triton.py), the torch reference elsewhere
(kernels/moe_ref.py). Chosen by the tensor's device.

    pairs      p = t·k + j: token t's j-th routed expert (T·k pairs)
    gate|up    h[p]  = x[t] @ W13[e]ᵀ            (+ LoRA: (x[t] @ A13[s, e]ᵀ) @ B13[s, e]ᵀ)
    down       y[p]  = silu(gate)·up @ W2[e]ᵀ    (+ LoRA likewise on the activation)
    combine    out[t] = Σ_j weight[t, j] · y[t·k + j]

where s is token t's adapter slot (none: no LoRA term). With tensor parallelism the
weights hold this rank's part of the experts' intermediate dim, and `out` is a partial sum.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from loramux_kernels.elementwise import silu_mul
from loramux_kernels.moe_ref import grouped_gemm_ref, pair_groups, route_ref

try:  # the Triton module is optional: absent on machines without Triton
    from loramux_kernels import moe_triton as _triton
except ImportError:
    _triton = None

__all__ = ["ExpertLoRA", "fused_moe", "route"]


class ExpertLoRA(NamedTuple):
    """Expert LoRA of one layer for a batch: slot-pool buffers (scaling folded into B,
    rank columns past an adapter's rank zero) and each token's slot (-1: none).

    a13: [L, E, R, hidden], b13: [L, E, N13, R] (gate|up rows); a2: [L, E, R, inter],
    b2: [L, E, hidden, R]; either pair may be None (no adapter wraps it)."""
    token_slots: torch.Tensor
    a13: torch.Tensor | None
    b13: torch.Tensor | None
    a2: torch.Tensor | None
    b2: torch.Tensor | None


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """(weights [T, k], expert ids [T, k]) of each token (kernels/moe_ref.py)."""
    return route_ref(router_logits, top_k, norm_topk_prob)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              lora: ExpertLoRA | None = None) -> torch.Tensor:
    """Σ_j weight[t, j] · expert_{ids[t, j]}(x[t]) for every token (module docstring).

    x: [T, hidden]; w13: [E, 2I, hidden] (gate rows, then up rows); w2: [E, hidden, I];
    topk_weights, topk_ids: [T, k]. Returns [T, hidden] in x's dtype."""
    gpu = x.is_cuda and _triton is not None
    return _run(_triton if gpu else None, x, w13, w2, topk_weights, topk_ids, lora)


def _run(impl, x, w13, w2, topk_weights, topk_ids, lora):
    """The stages of `fused_moe` on `impl` (loramux_kernels.moe_triton; None: the reference)."""
    T, k = topk_ids.shape
    E = w13.shape[0]
    experts = topk_ids.reshape(-1)
    plan = impl.align(experts, E) if impl else experts
    gemm = impl.grouped_gemm if impl else grouped_gemm_ref
    h = gemm(x, w13, plan, k, torch.empty(T * k, w13.shape[1], dtype=x.dtype, device=x.device))
    lora_plan = None
    if lora is not None:
        lora_plan = (impl.align_lora(topk_ids, lora.token_slots, E, _slots(lora)) if impl
                     else pair_groups(topk_ids, lora.token_slots, E))
    if lora_plan is not None and lora.a13 is not None:
        _add_lora(gemm, x, k, lora.a13, lora.b13, lora_plan, h)
    act = silu_mul(h)
    y = gemm(act, w2, plan, 1, torch.empty(T * k, w2.shape[1], dtype=x.dtype, device=x.device))
    if lora_plan is not None and lora.a2 is not None:
        _add_lora(gemm, act, 1, lora.a2, lora.b2, lora_plan, y)
    return (y.view(T, k, -1) * topk_weights.unsqueeze(-1)).sum(dim=1)


def _slots(lora: ExpertLoRA) -> int:
    pool = lora.a13 if lora.a13 is not None else lora.a2
    return pool.shape[0]


def _add_lora(gemm, a, a_row_div, lora_a, lora_b, plan, out) -> None:
    """out[p] += (a[p // div] @ A[s, e]ᵀ) @ B[s, e]ᵀ, the rank-R intermediate in float32."""
    L, E, R, K = lora_a.shape
    # rows of pairs outside the plan stay unwritten: the second product reads only the
    # plan's rows
    shrunk = torch.empty(out.shape[0], R, dtype=torch.float32, device=out.device)
    gemm(a, lora_a.reshape(L * E, R, K), plan, a_row_div, shrunk)
    gemm(shrunk, lora_b.reshape(L * E, lora_b.shape[2], R), plan, 1, out, accumulate=True)
