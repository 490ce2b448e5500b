"""How the base model is split across tensor-parallel ranks (Megatron style).

One place for the arithmetic, shared by the layers, the weight loader and the LoRA pool,
so that a LoRA B matrix is always cut exactly like the base weight it adds to.

Attention heads: rank r of `size` holds query heads [r*H/size, (r+1)*H/size). KV heads are
split the same way when num_kv_heads >= size; when there are fewer KV heads than ranks,
each KV head is replicated on size/num_kv_heads consecutive ranks (the ranks whose query
heads use it), so every rank holds exactly one KV head.

    num_kv_heads=2, size=4:   rank 0 1 | 2 3
                              kv head 0 | 1

MLP: the intermediate dimension is split into equal contiguous blocks. Vocabulary: each
rank holds ceil(vocab/size) rows, the last rank fewer (see `vocab_range`).
"""
from __future__ import annotations

from dataclasses import dataclass

from loramux_core.errors import ModelLoadError


@dataclass(frozen=True)
class Shard:
    """A contiguous range [start, start + length) of one dimension of a full tensor."""
    start: int
    length: int

    @property
    def stop(self) -> int:
        return self.start + self.length


def check_divisible(cfg, size: int) -> None:
    """Raise ModelLoadError when the model cannot be split across `size` ranks."""
    if cfg.num_heads % size:
        raise ModelLoadError(
            f"config.json: num_attention_heads={cfg.num_heads} is not divisible by "
            f"tensor-parallel size {size}")
    kvh = cfg.num_kv_heads
    if (kvh >= size and kvh % size) or (kvh < size and size % kvh):
        raise ModelLoadError(
            f"config.json: num_key_value_heads={kvh} and tensor-parallel size {size} "
            f"must divide one another")
    if cfg.intermediate_size % size:
        raise ModelLoadError(
            f"config.json: intermediate_size={cfg.intermediate_size} is not divisible by "
            f"tensor-parallel size {size}")
    moe = getattr(cfg, "moe", None)
    if moe is not None and moe.intermediate_size % size:
        raise ModelLoadError(
            f"config.json: moe_intermediate_size={moe.intermediate_size} is not divisible by "
            f"tensor-parallel size {size}")


def even_shard(total: int, rank: int, size: int) -> Shard:
    """Rank `rank`'s equal block of a dimension of `total` (total % size == 0)."""
    assert total % size == 0, (total, size)
    n = total // size
    return Shard(rank * n, n)


def q_heads(cfg, rank: int, size: int) -> Shard:
    """Query heads held by `rank` (in heads, not rows)."""
    return even_shard(cfg.num_heads, rank, size)


def kv_heads(cfg, rank: int, size: int) -> Shard:
    """KV heads held by `rank`: an equal block, or one replicated head."""
    kvh = cfg.num_kv_heads
    if kvh >= size:
        return even_shard(kvh, rank, size)
    return Shard(rank // (size // kvh), 1)


def rows(heads: Shard, head_dim: int) -> Shard:
    """The rows of a projection weight that belong to a range of heads."""
    return Shard(heads.start * head_dim, heads.length * head_dim)


def vocab_range(vocab_size: int, rank: int, size: int) -> Shard:
    """Vocabulary rows held by `rank`: ceil(vocab/size) each, the tail rank fewer
    (possibly zero); the per-rank tensors are padded to the same height."""
    per = -(-vocab_size // size)
    start = min(rank * per, vocab_size)
    return Shard(start, min(per, vocab_size - start))


def padded_vocab_per_rank(vocab_size: int, size: int) -> int:
    return -(-vocab_size // size)
