"""Host wrapper of the one-launch LoRA kernel (kernels/lora_uniform_kernels_triton.py): a
decode path of `kernels.lora_triton.add_lora` when the batch (likely) uses one adapter, taken
with kernels/lora_triton.py UNIFORM_ONE_LAUNCH (off by default).

Shrink and expand of a layer group in one launch instead of two. Measured on an H100 it is
slower than the two token kernels back to back in a CUDA graph (10.9-13.4 against
6.2-10.5 us per group, qkv and down at 1 and 64 tokens): the in-kernel handoff from the
shrink programs to the expand programs costs more than a kernel boundary. Kept for the
record and for its halves (`uniform_shrink` / `uniform_expand`). Grids come from static sizes only (token count,
slices, K and N), so the launch is capturable in CUDA graphs; the rows' slots are read on
the device from token_slots itself (no sort, no per-step metadata). Any token->slot
mapping is computed right (a block of several adapters is done adapter by adapter); a
one-adapter batch needs one pass per row block.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels import lora_uniform_kernels_triton as K

MAX_TOKENS = 256           # row blocks of 64: at most 4
_SHRINK_PROGRAMS = 64      # split-K programs wanted per launch (each reads x's K chunk once)
_MAX_SPLIT_K = 16          # partials an expand program sums (its loads are unrolled)
AHEAD_SPLIT_K = 4          # uniform_shrink: beside a base matmul its length is hidden, so
                           # few K chunks (the expand after it sums few partials)
_MAX_SLICES = 4

_sync: dict[tuple[str, int | None], torch.Tensor] = {}


def _sync_counters(device: torch.device) -> torch.Tensor:
    """The device's two int32 counters (shrinks done, expands done): zero between launches,
    the last expand program of a launch resets them. Launches on one device must not run
    concurrently on two streams (the engine's forward runs on one)."""
    key = (device.type, device.index)
    if key not in _sync:
        _sync[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return _sync[key]


def _resident_programs(device: torch.device) -> int:
    """Programs the grid may have: two per SM (what the GPU holds at once with room to
    spare); unbounded under the interpreter (programs run one after another)."""
    if device.type != "cuda":
        return 1 << 30
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _block_r(R: int) -> int:
    return max(16, triton.next_power_of_2(R))


def _precision(t: torch.Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class LaunchShape:
    block_m: int          # sorted rows per row block
    block_n: int          # output columns per expand tile
    block_k: int          # K step of the shrink loop
    split_k: int          # K chunks (shrink programs per row block and slice)
    k_chunk: int          # K width of a chunk (a multiple of block_k)
    cum_tiles: tuple[int, int, int, int]   # tiles before slice 1, 2, 3, and of all slices
    n_shrink: int
    n_expand: int

    @property
    def grid(self) -> tuple[int]:
        return (self.n_shrink + self.n_expand,)


def launch_shape(T: int, S: int, Kdim: int, slice_offsets: tuple[int, ...],
                 resident: int, R: int = 16, max_split: int = _MAX_SPLIT_K) -> LaunchShape:
    """Tile sizes and program counts for T tokens, S slices of input width Kdim, rank
    R (tiles narrow as the rank grows: B's [block_n, R] and A's [block_k, R] tiles stay
    about 4K values, as x's and y's [block_m, block_k or block_n])."""
    block_m = 16 if T <= 16 else 32 if T <= 32 else 64
    block_n = min(256 if block_m <= 32 else 128, max(32, 4096 // _block_r(R)))
    block_k = min(256 if block_m <= 16 else 128, max(32, 4096 // _block_r(R)))
    m_blocks = triton.cdiv(T, block_m)
    offs = list(slice_offsets) + [slice_offsets[-1]] * (_MAX_SLICES + 1 - len(slice_offsets))
    tiles = [triton.cdiv(hi - lo, block_n) for lo, hi in zip(offs, offs[1:])]
    cum = (tiles[0], sum(tiles[:2]), sum(tiles[:3]), sum(tiles))
    shrink_budget = min(_SHRINK_PROGRAMS, resident // 2)
    room = resident - m_blocks * cum[3]   # left beside one expand program per tile
    if m_blocks * S * 4 <= room < shrink_budget:
        shrink_budget = room              # fewer K chunks, but every tile in one wave
    shrink_budget = max(m_blocks * S, shrink_budget)
    split = max(1, min(triton.cdiv(Kdim, block_k), shrink_budget // (m_blocks * S),
                       max_split))
    k_chunk = triton.cdiv(triton.cdiv(Kdim, split), block_k) * block_k
    split = triton.cdiv(Kdim, k_chunk)           # no empty chunk
    n_shrink = m_blocks * S * split
    n_expand = max(1, min(m_blocks * cum[3], resident - n_shrink))
    return LaunchShape(block_m, block_n, block_k, split, k_chunk, cum, n_shrink, n_expand)


def add_lora_uniform(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     token_slots: torch.Tensor, slice_offsets: tuple[int, ...],
                     ranks: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, N] += x·A[slot]ᵀ·B[slot]ᵀ per slice for every token with a slot (-1: none),
    in place, in one launch (T <= MAX_TOKENS); returns y. Shapes as
    `kernels.lora_triton.add_lora` (checked there); ranks: [L] int32 or None (then R)."""
    shrunk = _prepare(x, a, token_slots, slice_offsets, ranks)
    _launch(0, shrunk, x, a, b, y, shrunk.shape.n_expand)
    return y


@dataclass(frozen=True)
class Shrunk:
    """A shrink launched by `uniform_shrink`: its split-K partials, for `uniform_expand`."""
    hp: torch.Tensor                   # [split_k, S, T, R] float32
    shape: LaunchShape
    token_slots: torch.Tensor
    slice_offsets: tuple[int, ...]
    ranks: torch.Tensor | None


def uniform_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor,
                   slice_offsets: tuple[int, ...],
                   ranks: torch.Tensor | None = None) -> Shrunk:
    """The shrink half of `add_lora_uniform` as a launch of its own (it needs only x, so it
    may run beside the base matmul on another stream); `uniform_expand` finishes it."""
    shrunk = _prepare(x, a, token_slots, slice_offsets, ranks, AHEAD_SPLIT_K)
    _launch(1, shrunk, x, a, x, x, 0)
    return shrunk


def uniform_expand(shrunk: Shrunk, b: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y += h·B[slot]ᵀ from a finished `uniform_shrink` (launched after it in stream order,
    or after waiting for it), in place; returns y."""
    sh = shrunk.shape
    n_tiles = triton.cdiv(shrunk.hp.shape[2], sh.block_m) * sh.cum_tiles[3]
    _launch(2, shrunk, shrunk.hp, shrunk.hp, b, y, min(n_tiles, _resident_programs(y.device)))
    return y


def _prepare(x, a, token_slots, slice_offsets, ranks, max_split=_MAX_SPLIT_K) -> Shrunk:
    T, Kdim = x.shape
    L, S, R, _ = a.shape
    assert 0 < T <= MAX_TOKENS and S <= _MAX_SLICES, (T, S)
    shape = launch_shape(T, S, Kdim, tuple(slice_offsets), _resident_programs(x.device), R,
                         max_split)
    hp = torch.empty((shape.split_k, S, T, R), dtype=torch.float32, device=x.device)
    return Shrunk(hp, shape, token_slots, tuple(slice_offsets), ranks)


def _launch(role: int, shrunk: Shrunk, x, a, b, y, n_expand: int) -> None:
    """One launch of the kernel in `role` (0: both halves, 1: shrink, 2: expand); the
    operands a role does not read are stand-ins."""
    sh, hp, offs = shrunk.shape, shrunk.hp, shrunk.slice_offsets
    S, T, R = hp.shape[1:]
    offsets = offs + (offs[-1],) * (_MAX_SLICES + 1 - len(offs))
    c1, c2, c3, per_block = sh.cum_tiles
    grid = (sh.n_shrink + n_expand if role == 0 else sh.n_shrink if role == 1 else n_expand,)
    ranks = shrunk.ranks
    K.lora_uniform_kernel[grid](
        x, a, b, y, hp, _sync_counters(hp.device), shrunk.token_slots,
        ranks if ranks is not None else shrunk.token_slots, T, x.shape[1], R, S, sh.k_chunk,
        sh.n_shrink, n_expand, per_block, *offsets, c1, c2, c3,
        x.stride(0), x.stride(1), *(a.stride() if a.dim() == 4 else (0, 0, 0, 0)),
        *(b.stride() if b.dim() == 3 else (0, 0, 0)), y.stride(0), y.stride(1), *hp.stride(),
        HAS_RANKS=ranks is not None, SPLIT_K=sh.split_k, BLOCK_M=sh.block_m,
        BLOCK_R=_block_r(R), BLOCK_K=sh.block_k, BLOCK_N=sh.block_n,
        PRECISION=_precision(b if role == 2 else a), UPCAST=hp.device.type == "cpu", ROLE=role)
