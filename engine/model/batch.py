"""The per-step batch the model runner hands the model: one flat run of new tokens from
many sequences (prefill chunks and decodes mixed), described for attention and LoRA.
`make_attention_metadata` builds the attention kernels' record, AttentionMetadata
(kernels/attention_metadata.py, which draws the flat layout), from per-sequence facts.
"""
from __future__ import annotations

import torch

from loramux_kernels.attention_metadata import AttentionMetadata


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
