"""How many KV blocks the pool gets, decided once at start."""
from __future__ import annotations

import torch

from loramux_core.errors import InvalidRequestError


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


def num_kv_blocks(requested: int | None, device: torch.device, utilization: float,
                  reserve_bytes: int, block_bytes: int, cap: int | None = None) -> int:
    """`requested` if set; on CUDA, what `utilization` of the device's memory leaves once
    the weights and the LoRA pool are in place (measured now) and `reserve_bytes` are
    held back for activations and CUDA graphs, at most `cap` (see max_useful_blocks: a
    tiny model would otherwise get millions of blocks); on the CPU, a fixed default."""
    if requested is not None:
        return requested
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return blocks_for_memory(total, free, utilization, reserve_bytes, block_bytes, cap)
    return CPU_DEFAULT_BLOCKS


def blocks_for_memory(total: int, free: int, utilization: float, reserve_bytes: int,
                      block_bytes: int, cap: int | None = None) -> int:
    """KV blocks in `utilization` of `total` bytes, less the bytes in use (`total - free`,
    ours and other processes') and `reserve_bytes`. Raises InvalidRequestError when not
    even one block fits."""
    budget = int(total * utilization) - (total - free) - reserve_bytes
    if budget < block_bytes:
        gib = 1 << 30
        raise InvalidRequestError(
            f"no memory left for the KV cache: gpu_memory_utilization={utilization} of "
            f"{total / gib:.1f} GiB, {(total - free) / gib:.1f} GiB in use after loading, "
            f"{reserve_bytes / gib:.1f} GiB held for activations; raise "
            "gpu_memory_utilization or lower max_loras / max_num_batched_tokens")
    blocks = budget // block_bytes
    return min(blocks, cap) if cap is not None else blocks
