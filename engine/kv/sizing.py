"""How many KV blocks the pool gets, decided once at start."""
from __future__ import annotations

import torch

CPU_DEFAULT_BLOCKS = 1024


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """K and V of every layer for one block on this rank."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def num_kv_blocks(requested: int | None, device: torch.device, fraction: float,
                  block_bytes: int) -> int:
    """`requested` if set; on CUDA, `fraction` of the memory free now (after the weights
    and the LoRA pool are in place); on the CPU, a fixed default."""
    if requested is not None:
        return requested
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return max(1, int(free * fraction) // block_bytes)
    return CPU_DEFAULT_BLOCKS
