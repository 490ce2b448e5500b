"""The per-step batch the model runner hands the model: one flat run of new tokens from
many sequences (prefill chunks and decodes mixed), described for attention and LoRA.

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


def make_attention_metadata(block_tables: list[list[int]], num_computed: list[int],
                            num_new: list[int], block_size: int,
                            device: torch.device | str = "cpu") -> AttentionMetadata:
    """Metadata for one step from plain per-sequence facts: sequence b already has
    `num_computed[b]` tokens in its blocks `block_tables[b]` and runs `num_new[b]` new
    tokens now (a prefill chunk, or 1 for a decode). Token order is sequence order."""
    assert len(block_tables) == len(num_computed) == len(num_new)
    positions, slots = [], []
    for table, done, new in zip(block_tables, num_computed, num_new):
        assert new >= 1 and len(table) * block_size >= done + new, (len(table), done, new)
        for pos in range(done, done + new):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    seq_lens = [d + n for d, n in zip(num_computed, num_new)]
    # a multiple of 16 columns: the table's row stride is an integer the attention kernel
    # is specialised on, so a free width would compile a variant per width class
    width = -(-max(len(t) for t in block_tables) // 16) * 16
    padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
    starts = [0]
    for n in num_new:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        max_query_len=max(num_new),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
