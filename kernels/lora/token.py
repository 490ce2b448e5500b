"""The token-sized LoRA kernels and their launches: the decode path (kernels/lora/plan.py
TOKENS) of `loramux_kernels.lora.launch.add_lora`, two launches per layer group.

Grids come from static sizes only (token count, slices, K and N), so the launches are
capturable in CUDA graphs; the groups' contents are read on the device from `LoRAMeta`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loramux_kernels.lora.tiles import expand_tile, rank_of, shrink_tile, slice_bounds


# ---- the programs ----------------------------------------------------------------------
# Triton programs for multi-adapter LoRA on small (decode) batches, sized by tokens.
#
# Launches: below. The grid is (token groups, GROUP, ...) over
# the step's tokens in slot-sorted order (`LoRAMeta.sorted_tokens` / `sorted_slots`), with
# GROUP = 16, 32 or 64 chosen from the token count. Each group is done at the coarsest level
# whose tokens all share one slot, so an adapter's A/B tile is read once per level block:
#
# - the whole group (GROUP rows, e.g. one adapter for the whole batch): one matrix product;
# - else each sub-group of SUB = 16 consecutive sorted tokens that share one slot: one
#   16-row matrix product (runs of requests on one adapter);
# - else one program per token with a vector product on its own slot's weights.
#
# The shrink writes split-K partial sums hp [SPLIT_K, S, T, R] (float32, plain stores, no
# zeroed buffer, no atomics); the expand adds the SPLIT_K partials up when it reads h. The
# expand's programs loop over output tiles: the GROUP (or SUB) programs of a uniform block
# share its tiles out between them, so no program of the grid is idle by construction, and
# a per-token program walks every N_CHUNKS-th tile of its slice.
# Tokens without a slot (-1, sorted last) are skipped by both kernels.


SUB: tl.constexpr = tl.constexpr(16)


@triton.jit
def _blocks(sorted_slots_ptr, T, GROUP: tl.constexpr):
    """This program's group and sub-group: bounds (inclusive), first slots, uniformity."""
    first = tl.program_id(0) * GROUP
    last = tl.minimum(first + GROUP, T) - 1
    slot0 = tl.load(sorted_slots_ptr + first)
    big = (slot0 == tl.load(sorted_slots_ptr + last)) & (last > first)
    sfirst = tl.minimum(first + (tl.program_id(1) // SUB) * SUB, last)
    slast = tl.minimum(sfirst + SUB, last + 1) - 1
    sslot = tl.load(sorted_slots_ptr + sfirst)
    sub = (sslot == tl.load(sorted_slots_ptr + slast)) & (slast > sfirst)
    return first, last, slot0, big, sfirst, slast, sslot, sub


@triton.jit
def _shrink_rows(x_ptr, a_ptr, h_base, sorted_ptr, ranks_ptr, row0, last, slot, s, R,
                 k_lo, k_hi, stride_xt, stride_xk, stride_al, stride_as, stride_ar, stride_ak,
                 stride_ht, stride_hr, HAS_RANKS: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):
    """hp rows of sorted positions row0..last (one slot): one ROWS-row matrix product."""
    rank = rank_of(ranks_ptr, slot, R, HAS_RANKS)
    offs_m = row0 + tl.arange(0, ROWS)
    m_mask = offs_m <= last
    tok = tl.load(sorted_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    acc = shrink_tile(x_ptr, a_ptr, tok, m_mask, slot, s, rank, k_lo, k_hi,
                       stride_xt, stride_xk, stride_al, stride_as, stride_ar,
                       stride_ak, ROWS, BLOCK_R, BLOCK_K, PRECISION, UPCAST)
    offs_r = tl.arange(0, BLOCK_R)
    tl.store(h_base + tok[:, None] * stride_ht + offs_r[None, :] * stride_hr, acc,
             mask=m_mask[:, None] & (offs_r < R)[None, :])


# T (the step's tokens) only bounds rows: no variant per value class (1, a
# multiple of 16, other), which would triple the compiles of every shape
@triton.jit(do_not_specialize=["T"])
def lora_shrink_tok_kernel(x_ptr, a_ptr, hp_ptr, sorted_ptr, sorted_slots_ptr, ranks_ptr,
                           T, K, R,
                           stride_xt, stride_xk, stride_al, stride_as, stride_ar, stride_ak,
                           stride_hk, stride_hs, stride_ht, stride_hr,
                           HAS_RANKS: tl.constexpr, SPLIT_K: tl.constexpr,
                           GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_KG: tl.constexpr, PRECISION: tl.constexpr,
                           UPCAST: tl.constexpr):
    """Grid (cdiv(T, GROUP), min(GROUP, T), S * SPLIT_K):
    hp[ks, s, tok, :] = x[tok, K range ks] @ a[slot(tok), s, :, K range ks].T."""
    s = tl.program_id(2) // SPLIT_K
    ks = tl.program_id(2) % SPLIT_K
    j = tl.program_id(1)
    first, last, slot0, big, sfirst, slast, sslot, sub = _blocks(sorted_slots_ptr, T, GROUP)
    k_chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = ks * k_chunk
    k_hi = tl.minimum(K, k_lo + k_chunk)
    h_base = hp_ptr + ks * stride_hk + s * stride_hs
    if big:
        if (j == 0) & (slot0 >= 0):
            _shrink_rows(x_ptr, a_ptr, h_base, sorted_ptr, ranks_ptr, first, last, slot0, s, R,
                         k_lo, k_hi, stride_xt, stride_xk, stride_al, stride_as, stride_ar,
                         stride_ak, stride_ht, stride_hr, HAS_RANKS, GROUP, BLOCK_R, BLOCK_KG,
                         PRECISION, UPCAST)
    elif sub:
        if (j % SUB == 0) & (sslot >= 0):
            _shrink_rows(x_ptr, a_ptr, h_base, sorted_ptr, ranks_ptr, sfirst, slast, sslot, s,
                         R, k_lo, k_hi, stride_xt, stride_xk, stride_al, stride_as, stride_ar,
                         stride_ak, stride_ht, stride_hr, HAS_RANKS, SUB, BLOCK_R, BLOCK_K,
                         PRECISION, UPCAST)
    else:
        p = first + j
        slot = tl.load(sorted_slots_ptr + tl.minimum(p, last))
        if (p <= last) & (slot >= 0):
            rank = rank_of(ranks_ptr, slot, R, HAS_RANKS)
            tok = tl.load(sorted_ptr + p).to(tl.int64)
            offs_r = tl.arange(0, BLOCK_R)
            r_mask = offs_r < rank
            a_base = a_ptr + slot.to(tl.int64) * stride_al + s * stride_as
            acc = tl.zeros([BLOCK_R], dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < k_hi
                xv = tl.load(x_ptr + tok * stride_xt + offs_k * stride_xk, mask=k_mask,
                             other=0.0).to(tl.float32)
                at = tl.load(a_base + offs_r[:, None] * stride_ar + offs_k[None, :] * stride_ak,
                             mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(at * xv[None, :], axis=1)
            tl.store(h_base + tok * stride_ht + offs_r * stride_hr, acc, mask=offs_r < R)


@triton.jit
def _expand_rows(hp_ptr, b_ptr, y_ptr, sorted_ptr, ranks_ptr, scale_ptr, row0, last, slot,
                 R, lo, hi, u0, u_step, h_base, stride_hk, stride_ht, stride_hr,
                 stride_bl, stride_bn, stride_br, stride_yt, stride_yn,
                 HAS_RANKS: tl.constexpr, HAS_SCALE: tl.constexpr, SPLIT_K: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """y rows of sorted positions row0..last (one slot) += h @ B.T over the slice's
    BLOCK_N tiles u0, u0 + u_step, ... (h summed over the split-K partials once, then
    with HAS_SCALE each row times scale[tok])."""
    n_tiles = tl.cdiv(hi - lo, BLOCK_N)
    if u0 < n_tiles:
        rank = rank_of(ranks_ptr, slot, R, HAS_RANKS)
        offs_m = row0 + tl.arange(0, ROWS)
        m_mask = offs_m <= last
        tok = tl.load(sorted_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        h_mask = m_mask[:, None] & (offs_r < rank)[None, :]
        h_ptrs = h_base + tok[:, None] * stride_ht + offs_r[None, :] * stride_hr
        h = tl.zeros([ROWS, BLOCK_R], dtype=tl.float32)
        for ks in tl.static_range(SPLIT_K):
            h += tl.load(h_ptrs + ks * stride_hk, mask=h_mask, other=0.0)
        if HAS_SCALE:
            h = h * tl.load(scale_ptr + tok, mask=m_mask, other=0.0)[:, None]
        for i in range(0, tl.cdiv(n_tiles - u0, u_step)):   # (a tensor step: not in range)
            expand_tile(h, b_ptr, y_ptr, tok, m_mask, slot, rank,
                         lo + (u0 + i * u_step) * BLOCK_N, hi,
                         stride_bl, stride_bn, stride_br, stride_yt, stride_yn,
                         BLOCK_R, BLOCK_N, PRECISION, UPCAST)


# T (the step's tokens) only bounds rows: no variant per value class (1, a
# multiple of 16, other), which would triple the compiles of every shape
@triton.jit(do_not_specialize=["T"])
def lora_expand_tok_kernel(hp_ptr, b_ptr, y_ptr, sorted_ptr, sorted_slots_ptr, ranks_ptr,
                           scale_ptr, T, R, n_chunks, o0, o1, o2, o3, o4,
                           stride_hk, stride_hs, stride_ht, stride_hr,
                           stride_bl, stride_bn, stride_br, stride_yt, stride_yn,
                           HAS_RANKS: tl.constexpr, HAS_SCALE: tl.constexpr,
                           SPLIT_K: tl.constexpr,
                           GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_NG: tl.constexpr, PRECISION: tl.constexpr,
                           UPCAST: tl.constexpr):
    """Grid (cdiv(T, GROUP), min(GROUP, T), S * n_chunks):
    y[tok, slice s] += (sum_ks hp[ks, s, tok]) @ b[slot(tok), slice s].T, with HAS_SCALE
    the sum times scale[tok] first (a row factor the shrink could not apply: the 1/rms of
    kernels/lora/norm_shrink.py).

    Lane (j, c) of a uniform block of LANES programs takes tiles j * n_chunks + c, stepping
    by LANES * n_chunks; a per-token program takes tiles c, c + n_chunks, ..."""
    s = tl.program_id(2) // n_chunks
    c = tl.program_id(2) % n_chunks
    j = tl.program_id(1)
    lo, hi = slice_bounds(s, o0, o1, o2, o3, o4)
    first, last, slot0, big, sfirst, slast, sslot, sub = _blocks(sorted_slots_ptr, T, GROUP)
    h_base = hp_ptr + s * stride_hs
    if big:
        if slot0 >= 0:
            _expand_rows(hp_ptr, b_ptr, y_ptr, sorted_ptr, ranks_ptr, scale_ptr, first, last,
                         slot0, R, lo, hi, j * n_chunks + c, GROUP * n_chunks, h_base,
                         stride_hk, stride_ht, stride_hr, stride_bl, stride_bn, stride_br,
                         stride_yt, stride_yn, HAS_RANKS, HAS_SCALE, SPLIT_K, GROUP, BLOCK_R,
                         BLOCK_NG, PRECISION, UPCAST)
    elif sub:
        if sslot >= 0:
            _expand_rows(hp_ptr, b_ptr, y_ptr, sorted_ptr, ranks_ptr, scale_ptr, sfirst, slast,
                         sslot, R, lo, hi, (j % SUB) * n_chunks + c, SUB * n_chunks, h_base,
                         stride_hk, stride_ht, stride_hr, stride_bl, stride_bn, stride_br,
                         stride_yt, stride_yn, HAS_RANKS, HAS_SCALE, SPLIT_K, SUB, BLOCK_R,
                         BLOCK_N, PRECISION, UPCAST)
    else:
        p = first + j
        slot = tl.load(sorted_slots_ptr + tl.minimum(p, last))
        if (p <= last) & (slot >= 0):
            rank = rank_of(ranks_ptr, slot, R, HAS_RANKS)
            tok = tl.load(sorted_ptr + p).to(tl.int64)
            offs_r = tl.arange(0, BLOCK_R)
            r_mask = offs_r < rank
            h = tl.zeros([BLOCK_R], dtype=tl.float32)
            for ks in tl.static_range(SPLIT_K):
                h += tl.load(h_base + ks * stride_hk + tok * stride_ht + offs_r * stride_hr,
                             mask=r_mask, other=0.0)
            if HAS_SCALE:
                h = h * tl.load(scale_ptr + tok)
            b_base = b_ptr + slot.to(tl.int64) * stride_bl
            for i in range(0, tl.cdiv(tl.cdiv(hi - lo, BLOCK_N) - c, n_chunks)):
                offs_n = lo + (c + i * n_chunks) * BLOCK_N + tl.arange(0, BLOCK_N)
                n_mask = offs_n < hi
                bt = tl.load(b_base + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                             mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
                delta = tl.sum(bt * h[None, :], axis=1)
                y_ptrs = y_ptr + tok * stride_yt + offs_n * stride_yn
                yv = tl.load(y_ptrs, mask=n_mask, other=0.0)
                tl.store(y_ptrs, (yv.to(tl.float32) + delta).to(yv.dtype), mask=n_mask)


# ---- their launches --------------------------------------------------------------------

_TARGET_PROGRAMS = 2048    # per-token programs wanted per launch (about 16 per SM)
_MIN_K_CHUNK = 512         # below this a split-K program is mostly prologue
_MAX_SPLIT_K = 32          # up to 16 tokens (down at 1 token wants 28 splits) ...
_MAX_SPLIT_K_WIDE = 8      # ... above: every expand program of a token re-adds the partials
_MAX_SLICES = 4            # the expand kernels take five slice bounds


def _offsets(slice_offsets) -> list[int]:
    """The S+1 slice bounds padded to _MAX_SLICES+1 entries (repeating the last)."""
    offs = list(slice_offsets)
    return offs + [offs[-1]] * (_MAX_SLICES + 1 - len(offs))


def group_size(T: int) -> int:
    """Sorted tokens per group: a group that shares one slot is one GROUP-row product
    (one adapter for the whole batch reads A/B once per 64 tokens, not per 16)."""
    return 16 if T <= 16 else 32 if T <= 32 else 64


def _block_r(R: int) -> int:
    return max(16, triton.next_power_of_2(R))


def _tile(block_r: int) -> int:
    # a [tile, BLOCK_R] float32 register tile of about 4096 values (32 per thread at 4 warps)
    return max(32, min(256, 4096 // block_r))


def _precision(t: torch.Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"


def default_split_k(T: int, S: int, Kdim: int, uniform: bool = False) -> int:
    """Shrink split-K, measured on an H200 at rank 16 (benchmarks/results/sweep_lora.csv):
    1 token: 16 splits, 28 for down's 14336 (one program per K chunk is all there is);
    `uniform` (every token one adapter, so GROUP-row products): 8, 16 for down;
    17..64 mixed tokens: 4 (more re-adds partials in every expand program: 64 tokens of
    qkv over 64 adapters 25.6 -> 22.7 µs); otherwise about _TARGET_PROGRAMS per-token
    programs of at least _MIN_K_CHUNK each."""
    if T == 1:
        split = max(16, Kdim // _MIN_K_CHUNK)
    elif uniform:
        split = min(16, Kdim // _MIN_K_CHUNK)
    elif 16 < T <= 64:
        split = min(4, Kdim // _MIN_K_CHUNK)
    else:
        cap = _MAX_SPLIT_K if T <= 16 else _MAX_SPLIT_K_WIDE
        split = min(cap, Kdim // _MIN_K_CHUNK, -(-_TARGET_PROGRAMS // (T * S)))
    return max(1, min(split, _MAX_SPLIT_K, Kdim // 128))


def default_n_chunks(T: int, S: int, n_tiles: int, uniform: bool = False) -> int:
    """Expand programs per (token, slice), each looping over every n_chunks-th tile;
    measured as default_split_k: `uniform` groups 4 up to 16 tokens, else one program
    per 16 tiles (the GROUP rows share each tile); 17..64 mixed tokens 4, 8 for one
    slice; otherwise about _TARGET_PROGRAMS programs."""
    if uniform and T > 1:
        chunks = 4 if T <= 16 else -(-n_tiles // 16)
    elif 16 < T <= 64:
        chunks = 4 if S > 1 else 8
    else:
        chunks = -(-_TARGET_PROGRAMS // (T * S))
    return max(1, min(n_tiles, chunks))


def lora_shrink_tokens(x: torch.Tensor, a: torch.Tensor, meta, ranks: torch.Tensor | None = None,
                       split_k: int | None = None, uniform: bool = False) -> torch.Tensor:
    """Split-K partial sums hp [SPLIT_K, S, T, R] (float32) of x[t] @ a[slot(t), s].T.

    Rows of tokens without a slot are left unwritten (the expand never reads them).
    `uniform` (a hint: the tokens likely share one adapter) only picks the tuned split."""
    T, Kdim = x.shape
    L, S, R, _ = a.shape
    split_k = split_k or default_split_k(T, S, Kdim, uniform)
    hp = torch.empty((split_k, S, T, R), dtype=torch.float32, device=x.device)
    block_r = _block_r(R)
    group = group_size(T)
    block_k = _tile(block_r)
    grid = (triton.cdiv(T, group), min(group, T), S * split_k)
    lora_shrink_tok_kernel[grid](
        x, a, hp, meta.sorted_tokens, meta.sorted_slots,
        ranks if ranks is not None else meta.seg_len, T, Kdim, R,
        x.stride(0), x.stride(1), *a.stride(), *hp.stride(),
        HAS_RANKS=ranks is not None, SPLIT_K=split_k, GROUP=group, BLOCK_R=block_r,
        BLOCK_K=block_k, BLOCK_KG=max(32, min(block_k, 8192 // group)),
        PRECISION=_precision(a), UPCAST=x.is_cpu)
    return hp


def lora_expand_tokens(hp: torch.Tensor, b: torch.Tensor, y: torch.Tensor, meta,
                       offsets: list[int], num_slices: int,
                       ranks: torch.Tensor | None = None, block_n: int | None = None,
                       n_chunks: int | None = None, uniform: bool = False,
                       row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y[t, slice s] += (sum of hp's partials)[s, t] @ b[slot(t), slice s].T, in place.

    offsets: the slice bounds padded to five entries (`_offsets`); block_n and
    n_chunks (tile width, programs per token and slice) default to the tuned choice;
    row_scale [T] float32: each token's summed h is multiplied by it first (or None)."""
    split_k, S, T, R = hp.shape
    block_r = _block_r(R)
    group = group_size(T)
    block_n = block_n or _tile(block_r)
    # a GROUP-row tile keeps about 4096 float32 values per program, as the others
    block_ng = max(16, min(block_n, (block_n * SUB.value) // group))
    widest = max(hi - lo for lo, hi in zip(offsets[:num_slices], offsets[1:num_slices + 1]))
    n_chunks = n_chunks or default_n_chunks(T, num_slices, max(1, triton.cdiv(widest, block_n)),
                                        uniform)
    grid = (triton.cdiv(T, group), min(group, T), num_slices * n_chunks)
    lora_expand_tok_kernel[grid](
        hp, b, y, meta.sorted_tokens, meta.sorted_slots,
        ranks if ranks is not None else meta.seg_len,
        row_scale if row_scale is not None else hp, T, R, n_chunks, *offsets,
        *hp.stride(), *b.stride(), y.stride(0), y.stride(1),
        HAS_RANKS=ranks is not None, HAS_SCALE=row_scale is not None, SPLIT_K=split_k,
        GROUP=group, BLOCK_R=block_r,
        BLOCK_N=block_n, BLOCK_NG=block_ng, PRECISION=_precision(b), UPCAST=y.is_cpu)
    return y
