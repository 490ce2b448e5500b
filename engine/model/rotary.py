"""Rotary position embedding, Hugging Face convention (rotate_half: the two halves of a
head are the rotated pairs, "neox style"), with linear and llama3 frequency scaling.

The cos/sin table is built once for every position up to max_position_embeddings, in
float32 with the same operations as transformers, and looked up by each token's position.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from loramux_kernels.elementwise import rotary, rotary_store_kv


def inverse_frequencies(head_dim: int, theta: float, scaling: Mapping | None) -> torch.Tensor:
    """[head_dim/2] float32 inverse frequencies, scaled as the config asks."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    assert scaling["rope_type"] == "llama3", scaling
    return _llama3(inv_freq, scaling)


def _llama3(inv_freq: torch.Tensor, s: Mapping) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
    # between low_freq_wavelen and high_freq_wavelen interpolated smoothly.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """`forward(positions [T], q [T, H, D], k [T, KVH, D]) -> (q, k)` rotated.

    As in transformers, cos/sin are cast to the activations' dtype before use."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Mapping | None, device=None):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # kernels/elementwise: one in-place launch on CUDA, on the CPU
        # loramux_kernels.elementwise_ref.rotary_ref (the HF form)
        return rotary(positions, q, k, self.cos, self.sin)

    def rotate_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor):
        """forward, then the rotated k and v written to the paged KV cache at
        slot_mapping (< 0: skipped); one launch on CUDA. Returns (q, k)."""
        return rotary_store_kv(positions, q, k, v, self.cos, self.sin, k_cache, v_cache,
                               slot_mapping)
