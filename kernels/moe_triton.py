"""Mixture-of-experts grouped GEMM on the GPU (same semantics as
`loramux_kernels.moe_ref.grouped_gemm_ref`): one launch multiplies every routed (token, expert)
pair by its expert's weight.

The pairs are first laid out by group (`align`), each group's run padded to a multiple
of BLOCK_M so that every row block belongs to one group and reads one weight tile:

    group        [ 2  0  2  1  0 ]                (P = 5 pairs, G = 3 groups, BLOCK_M = 2)
    sorted_ids   [ 1  4 | 3  P | 0  2 | P  P ]    pair ids by group, P = padding
    block_group  [ 0      1      2      -1  ]     group of each row block, -1 = nothing

The sizes are static upper bounds (ceil(P / BLOCK_M) + min(G, P) blocks: at most P
groups hold pairs, and each adds at most one partly filled block), so nothing syncs with
the host and surplus programs return at once; a decode step of one token over 60 experts
launches 5 row blocks, not 61. BLOCK_M is 16 while groups hold few pairs
(decode: padding stays small) and 64 once they average 32 or more (prefill: each weight
tile is then read by fewer row blocks). Expert LoRA uses the same kernel with
groups (adapter slot, expert) over A and B viewed as [slots·experts, ...].
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from loramux_kernels.dot_triton import dot_f32
from loramux_kernels.moe_ref import pair_groups



class Alignment(NamedTuple):
    """Pairs laid out by group for `grouped_gemm` (module docstring)."""
    sorted_ids: torch.Tensor    # [num_blocks * block_m] int32 pair ids, num_pairs = padding
    block_group: torch.Tensor   # [num_blocks] int32 group of each row block, -1 = none
    num_pairs: int
    block_m: int


def block_m_for(num_pairs: int, num_groups: int) -> int:
    """Rows per block (module docstring), from static sizes only."""
    return 64 if num_pairs >= 32 * num_groups else 16


# up to this many pairs `align` is one launch (align_kernel, one program: decode and
# small prefills); beyond, torch ops (their launches are then small against the GEMMs)
ALIGN_KERNEL_MAX_PAIRS = 2048


def align(group: torch.Tensor, num_groups: int, block_m: int | None = None,
          use_kernel: bool | None = None) -> Alignment:
    """Lay the pairs out by group (negative groups dropped). Device ops only: one launch
    of align_kernel up to ALIGN_KERNEL_MAX_PAIRS pairs (`use_kernel` forces either way)."""
    return _align(group, None, 0, num_groups, block_m, use_kernel)


def align_lora(topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int,
               num_slots: int, block_m: int | None = None,
               use_kernel: bool | None = None) -> Alignment:
    """`align` of the expert-LoRA groups `pair_groups(topk_ids, token_slots, E)` over
    num_slots·E groups; align_kernel computes each pair's group itself."""
    if use_kernel is None:
        use_kernel = topk_ids.numel() <= ALIGN_KERNEL_MAX_PAIRS
    if not use_kernel:
        return align(pair_groups(topk_ids, token_slots, num_experts), num_slots * num_experts,
                     block_m, use_kernel=False)
    return _align(topk_ids.reshape(-1), token_slots, num_experts, num_slots * num_experts,
                  block_m, True)


def _align(group, token_slots, num_experts, num_groups, block_m, use_kernel) -> Alignment:
    P, dev = group.numel(), group.device
    block_m = block_m or block_m_for(P, num_groups)
    num_blocks = triton.cdiv(P, block_m) + min(num_groups, P)
    if use_kernel is None:
        use_kernel = P <= ALIGN_KERNEL_MAX_PAIRS
    if use_kernel and P:
        sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
        block_group = torch.empty(num_blocks, dtype=torch.int32, device=dev)
        work = torch.empty(3 * num_groups + P, dtype=torch.int32, device=dev)
        with_slots = token_slots is not None
        align_kernel[(1,)](group, token_slots if with_slots else group, sorted_ids,
                           block_group, work, P, num_groups, num_blocks,
                           P // max(1, token_slots.numel()) if with_slots else 1, num_experts,
                           WITH_SLOTS=with_slots, BLOCK_M=block_m, BLOCK_P=128, BLOCK_G=256,
                           LOG_G=num_groups.bit_length())
        return Alignment(sorted_ids, block_group, P, block_m)
    return _align_torch(group, num_groups, block_m, num_blocks)


@triton.jit
def _pair_key(group_ptr, slots_ptr, offs, P, top_k, num_experts, WITH_SLOTS: tl.constexpr):
    """(group of pairs `offs` clamped to >= 0, whether it is a real group)."""
    key = tl.load(group_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
    if WITH_SLOTS:   # expert LoRA: slot · E + expert, none for a base-model token
        slot = tl.load(slots_ptr + offs // top_k, mask=offs < P, other=-1).to(tl.int32)
        key = tl.where((slot >= 0) & (key >= 0), slot * num_experts + key, -1)
    valid = key >= 0
    return tl.where(valid, key, 0), valid


@triton.jit
def align_kernel(group_ptr, slots_ptr, sorted_ids_ptr, block_group_ptr, work_ptr, P, G,
                 num_blocks, top_k, num_experts, WITH_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_G: tl.constexpr,
                 LOG_G: tl.constexpr):
    """`align` in one program: count each group's pairs (each pair's rank in its group
    from comparisons within a chunk of pairs, no atomics), pad and scan the counts into
    each group's first row, write the pair ids there, and find each row block's group by
    binary search over the groups' cumulative block counts. The work arrays are written
    and read back by other threads of the program across barriers: their loads are
    volatile (not served from a stale cache line)."""
    counts = work_ptr            # [G] pairs seen so far per group
    starts = work_ptr + G        # [G] first row of each group
    ends = work_ptr + 2 * G      # [G] row blocks up to and including each group
    rank = work_ptr + 3 * G      # [P] each pair's rank within its group
    gi = tl.arange(0, BLOCK_G)
    pi = tl.arange(0, BLOCK_P)
    for g0 in range(0, G, BLOCK_G):
        tl.store(counts + g0 + gi, tl.zeros((BLOCK_G,), tl.int32), mask=g0 + gi < G)
    rows = num_blocks * BLOCK_M
    for r0 in range(0, rows, BLOCK_P):
        tl.store(sorted_ids_ptr + r0 + pi, tl.zeros((BLOCK_P,), tl.int32) + P,
                 mask=r0 + pi < rows)
    tl.debug_barrier()
    for p0 in range(0, P, BLOCK_P):
        offs = p0 + pi
        key, valid = _pair_key(group_ptr, slots_ptr, offs, P, top_k, num_experts, WITH_SLOTS)
        same = (key[:, None] == key[None, :]) & valid[:, None] & valid[None, :]
        before = tl.sum((same & (pi[None, :] < pi[:, None])).to(tl.int32), axis=1)
        after = tl.sum((same & (pi[None, :] > pi[:, None])).to(tl.int32), axis=1)
        base = tl.load(counts + key, mask=valid, other=0, volatile=True)
        tl.store(rank + offs, base + before, mask=valid)
        tl.debug_barrier()   # every count read before the group's last pair writes it
        tl.store(counts + key, base + before + 1, mask=valid & (after == 0))
        tl.debug_barrier()
    carry = tl.sum(tl.zeros((BLOCK_G,), tl.int32), axis=0)
    for g0 in range(0, G, BLOCK_G):
        m = g0 + gi < G
        blocks = (tl.load(counts + g0 + gi, mask=m, other=0, volatile=True) + BLOCK_M - 1) \
            // BLOCK_M
        incl = tl.cumsum(blocks, axis=0)
        tl.store(starts + g0 + gi, (carry + incl - blocks) * BLOCK_M, mask=m)
        tl.store(ends + g0 + gi, carry + incl, mask=m)
        carry += tl.sum(blocks, axis=0)
    tl.debug_barrier()
    for p0 in range(0, P, BLOCK_P):
        offs = p0 + pi
        key, valid = _pair_key(group_ptr, slots_ptr, offs, P, top_k, num_experts, WITH_SLOTS)
        at = (tl.load(starts + key, mask=valid, other=0, volatile=True)
              + tl.load(rank + offs, mask=valid, other=0, volatile=True))
        tl.store(sorted_ids_ptr + at, offs, mask=valid)
    for b0 in range(0, num_blocks, BLOCK_P):
        b = b0 + pi
        lo = tl.zeros((BLOCK_P,), tl.int32)
        hi = lo + G
        for _ in tl.static_range(LOG_G):   # the first group whose blocks end past b
            active = lo < hi
            mid = (lo + hi) // 2
            e = tl.load(ends + mid, mask=active, other=0, volatile=True)
            lo = tl.where(active & (e <= b), mid + 1, lo)
            hi = tl.where(active & (e > b), mid, hi)
        tl.store(block_group_ptr + b, tl.where(lo < G, lo, -1), mask=b < num_blocks)


def _align_torch(group: torch.Tensor, num_groups: int, block_m: int,
                 num_blocks: int) -> Alignment:
    """`align` in torch ops (some thirty launches)."""
    P, dev = group.numel(), group.device
    key = torch.where(group < 0, num_groups, group.long())
    # scatter_add, not bincount: bincount sizes its output from the data (a host sync,
    # which a CUDA graph capture refuses)
    counts = torch.zeros(num_groups + 1, dtype=torch.long, device=dev)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:num_groups]
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts
    order = torch.sort(key, stable=True).indices
    key_sorted = key[order]
    valid = key_sorted < num_groups
    g = key_sorted.clamp(max=num_groups - 1)
    pos = starts[g] + torch.arange(P, device=dev) - first[g]
    pos = torch.where(valid, pos, num_blocks * block_m)  # dropped pairs land past the end
    sorted_ids = torch.full((num_blocks * block_m + 1,), P, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, pos, order.to(torch.int32))
    block_end = torch.cumsum(padded // block_m, 0)
    blocks = torch.arange(num_blocks, device=dev)
    block_group = torch.searchsorted(block_end, blocks, right=True)
    block_group = torch.where(block_group < num_groups, block_group, -1).to(torch.int32)
    return Alignment(sorted_ids[:-1], block_group, P, block_m)


@triton.jit
def grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_group_ptr,
                        num_pairs, N, K, a_row_div,
                        stride_am, stride_ak, stride_wg, stride_wn, stride_wk,
                        stride_om, stride_on,
                        ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    group = tl.load(block_group_ptr + pid_m)
    if group < 0:
        return
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_pairs
    a_rows = (rows // a_row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_base = w_ptr + group.to(tl.int64) * stride_wg
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc += dot_f32(a.to(w.dtype), w, PRECISION, UPCAST)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = row_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, alignment: Alignment, a_row_div: int,
                 out: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    """out[p] (+)= a[p // a_row_div] @ w[group[p]]ᵀ for the pairs of `alignment`; rows of
    dropped pairs are left as they are. a: [M, K]; w: [G, N, K]; out: [P, N]."""
    G, N, K = w.shape
    if a.shape[1] != K or out.shape != (alignment.num_pairs, N):
        raise ValueError(f"shapes: a {tuple(a.shape)}, w {tuple(w.shape)}, out "
                         f"{tuple(out.shape)} for {alignment.num_pairs} pairs")
    block_n = min(64, max(16, triton.next_power_of_2(N)))
    block_k = min(64, max(16, triton.next_power_of_2(K)))
    grid = (alignment.block_group.numel(), triton.cdiv(N, block_n))
    if grid[0] == 0:   # no pairs
        return out
    precision = "ieee" if w.dtype == torch.float32 else "tf32"
    grouped_gemm_kernel[grid](
        a, w, out, alignment.sorted_ids, alignment.block_group, alignment.num_pairs, N, K,
        a_row_div, a.stride(0), a.stride(1), *w.stride(), out.stride(0), out.stride(1),
        ACCUMULATE=accumulate, BLOCK_M=alignment.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=precision, UPCAST=a.is_cpu)
    return out
