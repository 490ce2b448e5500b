"""Batched multi-adapter LoRA on the GPU: y += x·A_slot·B_slot for a mixed-adapter batch.

Same semantics as `kernels.lora_ref.add_lora_ref`. The step's token→slot mapping is
turned once into a `LoRAMeta` (tokens grouped by slot) that every layer reuses:

    token_slots    [ 2  0 -1  2  0 ]          (T = 5, L = 4 slots)
    sorted_tokens  [ 1  4  0  3  2 ]          stable sort by slot, no-adapter tokens last
    active_slots   [ 0  2 -1 -1 ]             slots with tokens first, padded with -1
    seg_start      [ 0  2  4  4 ]             where each active slot's run starts ...
    seg_len        [ 2  2  0  0 ]             ... and how long it is

Prefill runs as a grouped GEMM over a tile list (kernels/lora_segment_triton.py: each
segment cut into row tiles that share one A/B); decode batches take token-sized grids
(kernels/lora_token_triton.py), or for several adapters the tiles of their segments
(kernels/lora_mixed_triton.py, where its table says so). Nothing here syncs with the
host: grids come from static sizes (token count, slot count) and surplus programs return
at once, so the launches can be captured in CUDA graphs with static metadata buffers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton

from kernels import lora_kernels_triton as K
from kernels import lora_mixed_triton
from kernels.lora_segment_triton import add_lora_seg
from kernels.lora_token_triton import _MAX_SLICES, _offsets, lora_expand_tokens, lora_shrink_tokens
from kernels.lora_uniform_triton import add_lora_uniform
from kernels.norm_shrink_triton import add_rms_norm_shrink, expand_fused_shrunk
from kernels.norm_shrink_triton import fits as fused_shrink_fits
from kernels.silu_shrink_triton import silu_mul_shrink
from kernels.lora_uniform_triton import uniform_expand as add_lora_uniform_expand
from kernels.lora_uniform_triton import uniform_shrink as add_lora_uniform_shrink

FUSED_MAX_TOKENS = 16      # lora_fused needs every segment within one 16-row block
_TARGET_PROGRAMS = 264     # about two programs per SM on an H100 (132 SMs)


@dataclass(frozen=True)
class LoRAMeta:
    """Per-step LoRA batch layout, built once by `build_meta` and shared by all layers."""
    sorted_tokens: torch.Tensor  # [T] int32 token indices grouped by slot, -1 tokens last
    active_slots: torch.Tensor   # [L] int32 slots that have tokens, then -1
    seg_start: torch.Tensor      # [L] int32 start of each active slot's run in sorted_tokens
    seg_len: torch.Tensor        # [L] int32 length of that run (0 past the active ones)
    sorted_slots: torch.Tensor   # [T] int32 slot of each sorted token (-1 last)
    counters: torch.Tensor       # [4 * min(T, 256)] int32 zeros: the mixed decode shrink's
                                 # arrival counters (kernels/lora_mixed_triton.py), which
                                 # every launch leaves zero
    num_tokens: int
    num_slots: int
    # the prefill path's tile lists by block size, built on first use (lora_segment_triton)
    tiles: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def max_segments(self) -> int:
        """Static bound on active slots: sizes grid axes without a host sync."""
        return max(1, min(self.num_tokens, self.num_slots))


def build_meta(token_slots: torch.Tensor, num_slots: int) -> LoRAMeta:
    """Group the step's tokens by adapter slot (-1 = no adapter). Device ops only."""
    if token_slots.dim() != 1:
        raise ValueError(f"token_slots must be 1-D [T], got shape {tuple(token_slots.shape)}")
    if num_slots < 1:
        raise ValueError(f"num_slots={num_slots}: must be >= 1")
    dev = token_slots.device
    key = torch.where(token_slots < 0, num_slots, token_slots.long())
    key_sorted, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_slots + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    starts = torch.cumsum(counts, 0) - counts
    # slots with tokens first (in slot order), then the empty ones
    by_activity = torch.sort((counts[:num_slots] == 0).to(torch.int32), stable=True).indices
    seg_len = counts[by_activity]
    active = torch.where(seg_len > 0, by_activity, torch.full_like(by_activity, -1))
    return LoRAMeta(sorted_tokens=order.to(torch.int32), active_slots=active.to(torch.int32),
                    seg_start=starts[by_activity].to(torch.int32),
                    seg_len=seg_len.to(torch.int32),
                    sorted_slots=torch.where(key_sorted == num_slots, -1,
                                             key_sorted).to(torch.int32),
                    counters=torch.zeros(4 * min(token_slots.shape[0],
                                                 TOKEN_PATH_MAX_TOKENS),
                                         dtype=torch.int32, device=dev),
                    num_tokens=token_slots.shape[0], num_slots=num_slots)


def _check(y, x, a, b, token_slots, slice_offsets, meta):
    T, Kdim = x.shape
    L, S, R, Ka = a.shape
    if Ka != Kdim:
        raise ValueError(f"x has width {Kdim} but a [L, S, R, K] has K={Ka}")
    if len(slice_offsets) != S + 1 or slice_offsets[0] != 0:
        raise ValueError(f"slice_offsets={slice_offsets}: need S+1={S + 1} ints from 0")
    if S > _MAX_SLICES:
        raise ValueError(f"a has {S} slices; the kernels handle at most {_MAX_SLICES}")
    if any(hi < lo for lo, hi in zip(slice_offsets, slice_offsets[1:])):
        raise ValueError(f"slice_offsets={slice_offsets} must not decrease")
    if b.shape != (L, slice_offsets[-1], R):
        raise ValueError(f"b has shape {tuple(b.shape)}, expected {(L, slice_offsets[-1], R)}")
    if y.shape != (T, slice_offsets[-1]):
        raise ValueError(f"y has shape {tuple(y.shape)}, expected {(T, slice_offsets[-1])}")
    if token_slots.shape != (T,):
        raise ValueError(f"token_slots has shape {tuple(token_slots.shape)}, expected ({T},)")
    if meta is not None and (meta.num_tokens != T or meta.num_slots != L):
        raise ValueError(f"meta was built for T={meta.num_tokens}, L={meta.num_slots}; "
                         f"this call has T={T}, L={L}")


def _block_r(R: int) -> int:
    return max(16, triton.next_power_of_2(R))


def _precision(t: torch.Tensor) -> str:
    # fp32 weights mean "exact" (tests, CPU parity); tf32 would lose ~3 digits
    return "ieee" if t.dtype == torch.float32 else "tf32"


def lora_shrink(x: torch.Tensor, a: torch.Tensor, meta: LoRAMeta,
                ranks: torch.Tensor | None = None, block_m: int = 64,
                split_k: int | None = None) -> torch.Tensor:
    """h[s, t, :] = x[t] @ a[slot(t), s].T in float32, all slices in one launch.

    Returns h [S, T, R]; rows of tokens without a slot are left unwritten (never read).
    split_k > 1 (default: chosen to fill the GPU) sums K ranges atomically into a zeroed h."""
    T, Kdim = x.shape
    L, S, R, _ = a.shape
    m_blocks = triton.cdiv(T, block_m)
    block_r = _block_r(R)
    if split_k is None:
        split_k = max(1, min(_TARGET_PROGRAMS // (m_blocks * S), Kdim // 1024))
    alloc = torch.zeros if split_k > 1 else torch.empty
    h = alloc((S, T, R), dtype=torch.float32, device=x.device)
    block_k = 64 if block_r >= 64 else 128
    grid = (m_blocks, S * split_k, meta.max_segments)
    K.lora_shrink_kernel[grid](
        x, a, h, meta.sorted_tokens, meta.seg_start, meta.seg_len, meta.active_slots,
        ranks if ranks is not None else meta.seg_len, Kdim, R,
        x.stride(0), x.stride(1), *a.stride(), *h.stride(),
        HAS_RANKS=ranks is not None, SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_R=block_r,
        BLOCK_K=block_k, PRECISION=_precision(a), UPCAST=x.is_cpu)
    return h


def lora_expand(h: torch.Tensor, b: torch.Tensor, y: torch.Tensor, meta: LoRAMeta,
                slice_offsets: tuple[int, ...], ranks: torch.Tensor | None = None,
                block_m: int = 64, block_n: int = 128) -> torch.Tensor:
    """y[t, slice s] += h[s, t] @ b[slot(t), slice s].T in place, all slices in one launch."""
    T = y.shape[0]
    L, N, R = b.shape
    S = len(slice_offsets) - 1
    widest = max(hi - lo for lo, hi in zip(slice_offsets, slice_offsets[1:]))
    n_blocks = max(1, triton.cdiv(widest, block_n))
    grid = (triton.cdiv(T, block_m), S * n_blocks, meta.max_segments)
    K.lora_expand_kernel[grid](
        h, b, y, meta.sorted_tokens, meta.seg_start, meta.seg_len, meta.active_slots,
        ranks if ranks is not None else meta.seg_len, R, n_blocks, *_offsets(slice_offsets),
        *h.stride(), *b.stride(), y.stride(0), y.stride(1),
        HAS_RANKS=ranks is not None, BLOCK_M=block_m, BLOCK_R=_block_r(R),
        BLOCK_N=block_n, PRECISION=_precision(b), UPCAST=y.is_cpu)
    return y


def lora_fused(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               meta: LoRAMeta, slice_offsets: tuple[int, ...],
               ranks: torch.Tensor | None = None, block_n: int = 64) -> torch.Tensor:
    """Shrink and expand in one launch; for T <= FUSED_MAX_TOKENS (every segment fits)."""
    T, Kdim = x.shape
    L, S, R, _ = a.shape
    assert T <= FUSED_MAX_TOKENS, "fused path needs every segment within one row block"
    block_r = _block_r(R)
    widest = max(hi - lo for lo, hi in zip(slice_offsets, slice_offsets[1:]))
    # more programs per slice spread B over SMs but each re-reads A (from L2): cap it
    n_split = max(1, min(8, triton.cdiv(widest, block_n),
                         _TARGET_PROGRAMS // (meta.max_segments * S)))
    grid = (meta.max_segments, S, n_split)
    K.lora_fused_kernel[grid](
        x, a, b, y, meta.sorted_tokens, meta.seg_start, meta.seg_len, meta.active_slots,
        ranks if ranks is not None else meta.seg_len, Kdim, R, *_offsets(slice_offsets),
        n_split, x.stride(0), x.stride(1), *a.stride(), *b.stride(), y.stride(0), y.stride(1),
        HAS_RANKS=ranks is not None, BLOCK_M=16, BLOCK_R=block_r,
        BLOCK_K=128 if block_r <= 32 else 64, BLOCK_N=block_n, PRECISION=_precision(a),
        UPCAST=x.is_cpu)
    return y


TOKEN_PATH_MAX_TOKENS = 256   # decode batches: grids sized by tokens (lora_token_triton)


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             token_slots: torch.Tensor, slice_offsets: tuple[int, ...],
             ranks: torch.Tensor | None = None, meta: LoRAMeta | None = None,
             uniform: bool = False, spread: bool = False) -> torch.Tensor:
    """y [T, N] += LoRA(x) per token's slot (-1: nothing), in place; returns y.

    x [T, K]; a [L, S, R, K]; b [L, N, R] (scaling folded in); slice_offsets: S+1 ints;
    ranks [L] int32 real rank per slot (work stops there); meta: from `build_meta`, built
    here when absent and needed (pass it in: it is shared by every layer of a step; see
    `uses_meta`); uniform: a hint
    that the tokens share one adapter, which picks the decode path's launch parameters
    tuned for that (any mapping stays correct); spread: a hint that the rows average fewer
    than `mixed_min_rows` rows per adapter (the token kernels then; same result).

    Up to TOKEN_PATH_MAX_TOKENS tokens: with `uniform` (and UNIFORM_ONE_LAUNCH) one launch
    (kernels/lora_uniform_triton.py), else two launches: of the segment-tile kernels for
    a mixed batch, not `spread`, of a shape class their table gives them
    (kernels/lora_mixed_triton.py), else of the token-sized kernels; above it the two
    segment kernels."""
    slice_offsets = tuple(int(o) for o in slice_offsets)
    _check(y, x, a, b, token_slots, slice_offsets, meta)
    if x.shape[0] == 0 or slice_offsets[-1] == 0:
        return y
    if not uses_meta(x.shape[0], uniform):
        return add_lora_uniform(y, x, a, b, token_slots, slice_offsets, ranks)
    if meta is None:
        meta = build_meta(token_slots, a.shape[0])
    if x.shape[0] <= TOKEN_PATH_MAX_TOKENS:
        return add_lora_tokens(y, x, a, b, meta, slice_offsets, ranks, uniform, spread)
    return add_lora_segments(y, x, a, b, meta, slice_offsets, ranks)


def mixed_min_rows(device: torch.device, num_tokens: int) -> int:
    """Rows per adapter a mixed batch of num_tokens tokens needs on `device` for the
    segment-tile kernels (fewer: hint `spread` to add_lora, which then keeps the token
    kernels); 0 where the hint changes no launch (above TOKEN_PATH_MAX_TOKENS tokens, or no
    shape class of that size on the segment-tile kernels)."""
    if not 0 < num_tokens <= TOKEN_PATH_MAX_TOKENS:
        return 0
    return lora_mixed_triton.min_rows_per_adapter(torch.device(device), num_tokens)


# One launch per group for uniform calls (kernels/lora_uniform_triton.py): off, since on
# an H100 it was slower than the two token kernels back to back in a CUDA graph (qkv at one
# token 10.9 vs 6.2 us, at 64 tokens 12.0 vs 9.0 us): its in-kernel handoff from shrink to
# expand costs more than a kernel boundary. Kept selectable for the record.
UNIFORM_ONE_LAUNCH = False
ONE_LAUNCH_MAX_TOKENS = 256  # the one-launch path up to this many tokens (at most 256)


def uses_meta(num_tokens: int, uniform: bool) -> bool:
    """Whether add_lora reads a `LoRAMeta` for this call: not on the one-launch path
    (it reads token_slots as they are), so a uniform step need not build one."""
    return not (uniform and UNIFORM_ONE_LAUNCH
                and num_tokens <= min(ONE_LAUNCH_MAX_TOKENS, TOKEN_PATH_MAX_TOKENS))


def shrink_ahead(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor,
                 slice_offsets: tuple[int, ...], ranks: torch.Tensor | None,
                 meta: LoRAMeta | None):
    """The shrink half of a uniform decode call (T <= TOKEN_PATH_MAX_TOKENS) launched on
    its own, for `expand_after`: the token kernels' shrink with the uniform launch
    parameters, or with UNIFORM_ONE_LAUNCH the one-launch kernel's shrink."""
    offsets = tuple(int(o) for o in slice_offsets)
    if not uses_meta(x.shape[0], True):
        return ("one", add_lora_uniform_shrink(x, a, token_slots, offsets, ranks))
    if meta is None:
        meta = build_meta(token_slots, a.shape[0])
    return ("tok", lora_shrink_tokens(x, a, meta, ranks, uniform=True), meta, offsets, ranks)


def norm_shrink_ahead(x, residual, weight, eps, a, token_slots, slice_offsets,
                      ranks: torch.Tensor | None, meta: LoRAMeta | None, uniform: bool):
    """Add + RMSNorm and the shrink of its output in one launch
    (kernels/norm_shrink_triton.py): (out, new residual, shrunk for `expand_after`)."""
    offsets = tuple(int(o) for o in slice_offsets)
    T, Kdim = residual.shape
    L, S, R, Ka = a.shape
    if Ka != Kdim or len(offsets) != S + 1 or S > _MAX_SLICES:
        raise ValueError(f"a [L, S, R, K] {tuple(a.shape)} does not fit rows of width {Kdim} "
                         f"and slice_offsets={offsets} (at most {_MAX_SLICES} slices)")
    if token_slots.shape != (T,):
        raise ValueError(f"token_slots has shape {tuple(token_slots.shape)}, expected ({T},)")
    if meta is not None and (meta.num_tokens != T or meta.num_slots != L):
        raise ValueError(f"meta was built for T={meta.num_tokens}, L={meta.num_slots}; "
                         f"this call has T={T}, L={L}")
    if meta is None:
        meta = build_meta(token_slots, a.shape[0])
    out, residual, shrunk = add_rms_norm_shrink(x, residual, weight, eps, a, token_slots,
                                                offsets, ranks, uniform)
    return out, residual, ("fused", shrunk, meta)


def silu_shrink_ahead(x, a, token_slots, slice_offsets, ranks: torch.Tensor | None,
                      meta: LoRAMeta | None, uniform: bool):
    """SiLU-and-multiply and the shrink of its output in one launch
    (kernels/silu_shrink_triton.py): (out, shrunk for `expand_after`)."""
    offsets = tuple(int(o) for o in slice_offsets)
    T, two_i = x.shape
    L, S, R, Ka = a.shape
    if S != 1 or two_i != 2 * Ka or len(offsets) != 2:
        raise ValueError(f"a [L, S, R, K] {tuple(a.shape)} and slice_offsets={offsets}: need "
                         f"one slice of K={two_i // 2} (x is [gate | up] of width {two_i})")
    if token_slots.shape != (T,):
        raise ValueError(f"token_slots has shape {tuple(token_slots.shape)}, expected ({T},)")
    if meta is None:
        meta = build_meta(token_slots, L)
    out, shrunk = silu_mul_shrink(x, a, token_slots, offsets, ranks, uniform)
    return out, ("fused", shrunk, meta)


def expand_after(shrunk, b: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y += the delta of a finished `shrink_ahead`, `norm_shrink_ahead` or
    `silu_shrink_ahead` (after it in stream order), in place."""
    if shrunk[0] == "one":
        return add_lora_uniform_expand(shrunk[1], b, y)
    if shrunk[0] == "fused":
        return expand_fused_shrunk(shrunk[1], b, y, shrunk[2])
    _, hp, meta, offsets, ranks = shrunk
    return lora_expand_tokens(hp, b, y, meta, _offsets(offsets), len(offsets) - 1, ranks,
                              uniform=True)


def add_lora_tokens(y, x, a, b, meta: LoRAMeta, slice_offsets: tuple[int, ...],
                    ranks: torch.Tensor | None = None, uniform: bool = False,
                    spread: bool = False) -> torch.Tensor:
    """The decode path: token-sized grids (kernels/lora_token_triton.py), or for a mixed
    batch, not `spread`, whose shape class the table gives them, tiles of segments
    (kernels/lora_mixed_triton.py: each adapter's A and B read once per tile)."""
    if not uniform and lora_mixed_triton.takes(x, a, slice_offsets, spread):
        return lora_mixed_triton.add_lora_mixed(y, x, a, b, meta, slice_offsets, ranks)
    hp = lora_shrink_tokens(x, a, meta, ranks, uniform=uniform)
    return lora_expand_tokens(hp, b, y, meta, _offsets(slice_offsets), len(slice_offsets) - 1,
                              ranks, uniform=uniform)


SEGMENT_TILE_LIST = True     # False: the row-block segment kernels (benchmarks compare)


def add_lora_segments(y, x, a, b, meta: LoRAMeta, slice_offsets: tuple[int, ...],
                      ranks: torch.Tensor | None = None) -> torch.Tensor:
    """The prefill path: a grouped GEMM over a tile list (kernels/lora_segment_triton.py);
    with SEGMENT_TILE_LIST off, one program per (row block of T, slice, active slot)."""
    if SEGMENT_TILE_LIST:
        return add_lora_seg(y, x, a, b, meta, slice_offsets, ranks)
    block_m = 16 if x.shape[0] <= 64 else 64    # short segments: small row blocks
    h = lora_shrink(x, a, meta, ranks, block_m=block_m)
    return lora_expand(h, b, y, meta, slice_offsets, ranks, block_m=block_m)
