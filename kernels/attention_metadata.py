"""What the attention kernels read about one step: a flat run of new tokens from many
sequences (prefill chunks and decodes mixed). The engine builds it (engine/model/batch.py);
the kernels know only these tensors.

Flat layout of a step with three sequences (two decodes and a prefill chunk):

    tokens        | s0 | s1 | s2 s2 s2 s2 |
    query_start_loc 0    1    2           6
    seq_lens      = [cached0 + 1, cached1 + 1, cached2 + 4]

A token at flat index t of sequence b sits at `positions[t]`; it attends to context
positions 0..positions[t] of b, read through `block_tables[b]`, and its own K/V is written
to `slot_mapping[t]` (= block_id * block_size + offset) before attention runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    positions: torch.Tensor        # [T] int64
    slot_mapping: torch.Tensor     # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor         # [B] int32, context length after this step
    block_tables: torch.Tensor     # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]
