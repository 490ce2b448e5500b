"""How many KV blocks the pool gets, decided once at start."""
from __future__ import annotations

import torch

CPU_DEFAULT_BLOCKS = 1024


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """K and V of every layer for one block on this rank."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def max_useful_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks that every running sequence at full length would hold: more are never used
    (prefix-cache leftovers aside), and each block costs a host-side object."""
    return max_num_seqs * -(-max_model_len // block_size)


def num_kv_blocks(requested: int | None, device: torch.device, fraction: float,
                  block_bytes: int, cap: int | None = None) -> int:
    """`requested` if set; on CUDA, `fraction` of the memory free now (after the weights
    and the LoRA pool are in place), at most `cap` (see max_useful_blocks: a tiny model
    would otherwise get millions of blocks); on the CPU, a fixed default."""
    if requested is not None:
        return requested
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        blocks = max(1, int(free * fraction) // block_bytes)
        return min(blocks, cap) if cap is not None else blocks
    return CPU_DEFAULT_BLOCKS
