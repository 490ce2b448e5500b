"""Triton multi-adapter LoRA kernels against the torch reference (kernels/lora/reference.py):
add_lora on every path the planner (kernels/lora/plan.py) chooses, and each family's
launches alone. The mixed path's own cases: tests/test_kernels_lora_mixed.py; the fused
shrinks': tests/test_kernels_norm_shrink.py.

On a machine without CUDA the kernels run under the Triton interpreter: tests/conftest.py
sets TRITON_INTERPRET before any kernel module is imported, and
`test_kernels_run_as_this_machine_needs` fails if that did not take effect.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from loramux_kernels.lora import launch, mixed, mixed_kernels, plan, segment, token
from loramux_kernels.lora.launch import add_lora, build_meta
from loramux_kernels.lora.plan import TOKEN_PATH_MAX_TOKENS
from loramux_kernels.lora.reference import add_lora_ref, lora_expand_ref, lora_shrink_ref
from loramux_kernels.lora.segment import (add_lora_seg, build_tiles, fit_block, seg_expand, seg_shrink,
                                  tiles_bound)
from loramux_kernels.lora.token import _offsets, lora_expand_tokens, lora_shrink_tokens
from tests.support.lora_pool import slot_pool
from tests.support.triton_mode import check_kernel_mode

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=6e-2, rtol=3e-2)}
SLICES = {1: (0, 48), 2: (0, 40, 72), 3: (0, 32, 48, 64)}   # unequal widths (q/k/v under GQA)
K_IN = 48


def _pool(S, offsets, ranks, dtype, R=32, seed=0):
    """Slot pool with per-slot ranks: weights past a slot's rank are zero, as loaded."""
    return slot_pool(S, offsets, ranks, K_IN, dtype, DEV, R, seed)


def _slots(T, L, mapping, seed):
    g = torch.Generator().manual_seed(seed)
    if mapping == "contiguous":      # requests in order, each a run of tokens; one run no-adapter
        runs = torch.randint(1, 6, (T,), generator=g).cumsum(0)
        run_of = torch.searchsorted(runs, torch.arange(T), right=True)
        ts = (run_of % (L + 1)) - 1
    else:                            # every token anywhere; slot L-1 stays unused
        ts = torch.randint(-1, L - 1, (T,), generator=g)
    return ts.to(DEV)


def _inputs(T, N, dtype, seed):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, K_IN, generator=g).to(DEV, dtype)
    y = torch.randn(T, N, generator=g).to(DEV, dtype)   # poison: add-into a random y
    return x, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S", [1, 2, 3])
@pytest.mark.parametrize("T,mapping", [(1, "random"), (7, "random"), (16, "contiguous"),
                                       (17, "random"), (64, "contiguous"), (64, "random")])
def test_add_lora_matches_reference(dtype, S, T, mapping):
    offsets = SLICES[S]
    a, b, ranks = _pool(S, offsets, [8, 32, 16, 4, 16], dtype, seed=T + S)
    ts = _slots(T, a.shape[0], mapping, seed=T)
    x, y = _inputs(T, offsets[-1], dtype, seed=T)
    want = add_lora_ref(y.clone(), x, a, b, ts, offsets)
    got = add_lora(y.clone(), x, a, b, ts, offsets, ranks=ranks)
    torch.testing.assert_close(got, want, **TOL[dtype])
    none = ts < 0
    assert torch.equal(got[none], y[none]), "tokens without an adapter must be untouched"


# (tokens, uniform, spread, slots' rank) -> the path the planner picks for them on this
# machine's table (the CPU interpreter takes the H100's): one batch for each path and each
# way to it; one adapter from 32 tokens at rank >= 32 reads it once per tile, not per token
PLANNED = [(5, True, False, 32, plan.TOKENS), (100, True, False, 16, plan.TOKENS),
           (100, True, False, 32, plan.TILES), (40, False, False, 32, plan.TOKENS),
           (100, False, True, 32, plan.TOKENS), (100, False, False, 32, plan.MIXED),
           (200, False, False, 16, plan.MIXED), (300, False, False, 32, plan.TILES),
           (300, True, True, 16, plan.TILES)]


def _spy_paths(monkeypatch) -> list[str]:
    """The family launches add_lora makes, recorded by path name as they run."""
    ran = []

    def spy(name, inner):
        def run(*args, **kwargs):
            ran.append(name)
            return inner(*args, **kwargs)
        return run
    monkeypatch.setattr(launch, "lora_shrink_tokens", spy(plan.TOKENS, lora_shrink_tokens))
    monkeypatch.setattr(mixed, "add_lora_mixed", spy(plan.MIXED, mixed.add_lora_mixed))
    monkeypatch.setattr(launch, "add_lora_seg", spy(plan.TILES, add_lora_seg))
    return ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,uniform,spread,R,path", PLANNED)
def test_add_lora_runs_the_planned_path(dtype, T, uniform, spread, R, path, monkeypatch):
    """add_lora takes the one path plan.choose names for the batch (uniform and spread
    hints, token count, slots' rank, this device's table), and on each the result is the
    reference's: three slices, uneven ranks, random A and B, base rows untouched."""
    offsets = SLICES[3]
    a, b, ranks = _pool(3, offsets, [min(r, R) for r in (8, 32, 16, 4, 16)], dtype, R=R,
                        seed=T)
    mapping = "random" if not uniform else "contiguous"
    ts = torch.full((T,), 1, device=DEV) if uniform else _slots(T, a.shape[0], mapping, T)
    if uniform:
        ts[-2:] = -1                                   # a padded bucket's base rows
    x, y = _inputs(T, offsets[-1], dtype, seed=T + 1)
    assert plan.choose(x.device, T, uniform, spread, 3, K_IN, 32, R) == path
    ran = _spy_paths(monkeypatch)
    want = add_lora_ref(y.clone(), x, a, b, ts, offsets)
    got = add_lora(y.clone(), x, a, b, ts, offsets, ranks=ranks, uniform=uniform,
                   spread=spread)
    assert ran == [path]
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got[ts < 0], y[ts < 0]), "tokens without an adapter must be untouched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,mapping", [(17, "random"), (64, "contiguous")])
def test_segment_path_matches_reference(dtype, T, mapping):
    """The prefill path (add_lora takes it above TOKEN_PATH_MAX_TOKENS) on small shapes."""
    offsets = SLICES[3]
    a, b, ranks = _pool(3, offsets, [8, 32, 16, 4, 16], dtype, seed=T)
    ts = _slots(T, a.shape[0], mapping, seed=T + 1)
    x, y = _inputs(T, offsets[-1], dtype, seed=T + 2)
    want = add_lora_ref(y.clone(), x, a, b, ts, offsets)
    got = add_lora_seg(y.clone(), x, a, b, build_meta(ts, a.shape[0]), offsets, ranks)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,uniform,spread", [(1, True, False), (9, False, True),
                                              (64, False, False), (64, True, False),
                                              (300, False, False)])
def test_rank_256_on_every_path(dtype, T, uniform, spread):
    """A pool of max rank 256 (q/k/v: 768 rank columns) through the path each batch takes:
    the token kernels, the mixed segment tiles, the prefill tile list. On a GPU
    every launch must fit a program's shared memory (the tables' blocks are for rank 16)."""
    offsets = SLICES[3]
    a, b, ranks = _pool(3, offsets, [256, 64, 200], dtype, R=256, seed=T)
    ts = torch.full((T,), 2, device=DEV) if uniform else _slots(T, a.shape[0], "random", T)
    x, y = _inputs(T, offsets[-1], dtype, seed=T)
    want = add_lora_ref(y.clone(), x, a, b, ts, offsets)
    got = add_lora(y.clone(), x, a, b, ts, offsets, ranks=ranks, uniform=uniform,
                   spread=spread)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_blocks_fit_shared_memory():
    """fit_block halves a block until its buffers fit; rank-16 tiles keep the table's."""
    assert fit_block(128, (64 + 16) * 2, 0, 3, 227 * 1024) == 128
    assert fit_block(128, (64 + 256) * 4, 0, 3, 227 * 1024) == 32
    assert fit_block(128, 1 << 20, 0, 3, 1024) == 16   # never below 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["one", "one_some_base", "runs", "distinct"])
@pytest.mark.parametrize("uniform", [False, True])
def test_token_path_uniform_and_mixed_groups(dtype, case, uniform):
    """Groups of 16 sorted tokens: all one slot (one matrix product per group), mixed (one
    program per token), a group of a single token, base tokens inside a group. The
    `uniform` hint (launch parameters of a one-adapter graph) never changes the result."""
    T, offsets = 37, SLICES[2]
    a, b, ranks = _pool(2, offsets, [8, 32, 16, 4], dtype, seed=11)
    g = torch.Generator().manual_seed(len(case))
    ts = {"one": torch.full((T,), 2),
          "one_some_base": torch.where(torch.rand(T, generator=g) < 0.3, -1, 1),
          "runs": torch.arange(T) * 4 // T,
          "distinct": torch.randint(-1, 4, (T,), generator=g)}[case].to(DEV)
    x, y = _inputs(T, offsets[-1], dtype, seed=12)
    meta = build_meta(ts, a.shape[0])
    want = add_lora_ref(y.clone(), x, a, b, ts, offsets)
    hp = lora_shrink_tokens(x, a, meta, ranks, uniform=uniform)
    got = lora_expand_tokens(hp, b, y.clone(), meta, _offsets(offsets), 2, ranks,
                             uniform=uniform)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got[ts < 0], y[ts < 0])


@pytest.mark.parametrize("uniform", [False, True])
def test_launch_parameters_stay_in_range(uniform):
    """Every token count, slice count and width (Llama-3-8B, its TP=2 shards, the tests'):
    split-K chunks of at least 128 (or one split), at most one expand program per tile."""
    from loramux_kernels.lora.token import default_n_chunks, default_split_k
    for T in range(1, 257):
        for S, Kdim in ((3, 4096), (1, 2048), (2, 4096), (1, 14336), (1, 7168), (2, K_IN)):
            split = default_split_k(T, S, Kdim, uniform)
            assert 1 <= split <= 32 and (split == 1 or Kdim // split >= 128), (T, S, Kdim)
            for n_tiles in (1, 3, 16, 56):
                assert 1 <= default_n_chunks(T, S, n_tiles, uniform) <= n_tiles


def _token_slots_case(case: str, T: int, L: int):
    g = torch.Generator().manual_seed(len(case) + T)
    return {"one": torch.full((T,), L - 1),
            "one_some_base": torch.where(torch.rand(T, generator=g) < 0.3, -1, 1),
            "runs16": torch.arange(T) // 16 % L,          # sub-groups of 16 share a slot
            "runs": torch.arange(T) * 4 // T,
            "distinct": torch.randint(-1, L, (T,), generator=g)}[case].to(DEV)


@pytest.mark.parametrize("T,n_chunks", [(12, 1), (29, 3), (70, 2)])
@pytest.mark.parametrize("case", ["one", "one_some_base", "runs16", "runs", "distinct"])
def test_token_expand_loops_over_tiles(T, case, n_chunks):
    """Groups of 16/32/64 rows by token count; whole-group, sub-group and per-token levels;
    narrow tiles so every program loops over several (lanes of a uniform block share them)."""
    offsets = SLICES[3]
    a, b, ranks = _pool(3, offsets, [8, 32, 16, 4], torch.float32, seed=T)
    ts = _token_slots_case(case, T, a.shape[0])
    x, y = _inputs(T, offsets[-1], torch.float32, seed=T + 3)
    meta = build_meta(ts, a.shape[0])
    want = add_lora_ref(y.clone(), x, a, b, ts, offsets)
    hp = lora_shrink_tokens(x, a, meta, ranks, split_k=2)
    got = lora_expand_tokens(hp, b, y.clone(), meta, list(offsets) + [offsets[-1]], 3, ranks,
                             block_n=16, n_chunks=n_chunks)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[ts < 0], y[ts < 0])


def test_token_shrink_partials_sum_to_reference():
    """Split-K partials (plain stores, no zeroed buffer) add up to x·Aᵀ for every split."""
    offsets = SLICES[3]
    a, b, ranks = _pool(3, offsets, [8, 32, 16], torch.float32, seed=3)
    ts = _slots(40, 3, "random", seed=5)
    x, _ = _inputs(40, offsets[-1], torch.float32, seed=5)
    meta, valid = build_meta(ts, 3), ts >= 0
    want = lora_shrink_ref(x, a, ts)
    for split_k in (1, 3):
        hp = lora_shrink_tokens(x, a, meta, ranks, split_k=split_k)
        assert hp.shape == (split_k, 3, 40, a.shape[2])
        torch.testing.assert_close(hp.sum(0)[:, valid], want[:, valid], atol=1e-5, rtol=1e-5)


def test_meta_groups_tokens_by_slot():
    ts = torch.tensor([2, 0, -1, 2, 0, 0, -1, 5], device=DEV)
    meta = build_meta(ts, num_slots=6)
    assert meta.active_slots.tolist() == [0, 2, 5, -1, -1, -1]
    assert meta.seg_len.tolist()[:3] == [3, 2, 1] and meta.seg_len.tolist()[3:] == [0, 0, 0]
    order = meta.sorted_tokens.tolist()
    for slot, start, n in zip([0, 2, 5], meta.seg_start.tolist(), meta.seg_len.tolist()):
        assert order[start:start + n] == [t for t in range(8) if ts[t] == slot]
    assert sorted(order[6:]) == [2, 6]
    assert meta.sorted_slots.tolist() == [0, 0, 0, 2, 2, 5, -1, -1]


def _segment_slots(lens_slots, seed):
    """Tokens in runs of the given (length, slot) pairs, shuffled: segments of uneven length."""
    g = torch.Generator().manual_seed(seed)
    ts = torch.cat([torch.full((n,), slot) for n, slot in lens_slots])
    return ts[torch.randperm(ts.shape[0], generator=g)].to(DEV)


# 1, 17 and 300 rows, a no-adapter run, a 64-row run (a whole tile) and a 2-row run
PREFILL_RUNS = [(1, 2), (17, 0), (300, 3), (40, -1), (64, 1), (2, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S", [1, 2, 3])
def test_prefill_path_uneven_segments(dtype, S):
    """add_lora above TOKEN_PATH_MAX_TOKENS: segments of 1, 17 and 300 rows, no-adapter rows,
    ranks below the pool's max rank, 1-3 slices, fresh random A and B: the tile list."""
    offsets = SLICES[S]
    a, b, ranks = _pool(S, offsets, [8, 32, 16, 4, 16], dtype, seed=20 + S)
    ts = _segment_slots(PREFILL_RUNS, seed=S)
    T = ts.shape[0]
    assert T > TOKEN_PATH_MAX_TOKENS
    x, y = _inputs(T, offsets[-1], dtype, seed=30 + S)
    want = add_lora_ref(y.clone(), x, a, b, ts, offsets)
    got = add_lora(y.clone(), x, a, b, ts, offsets, ranks=ranks)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got[ts < 0], y[ts < 0]), "tokens without an adapter must be untouched"


@pytest.mark.parametrize("block_m", [16, 64])
def test_tile_list_covers_every_segment_row_once(block_m):
    """Tiles cut each segment into row blocks: every sorted row with a slot in exactly one
    tile of its own slot, tiles within the static bound, padding entries (-1, 0, 0)."""
    for seed, runs in enumerate([PREFILL_RUNS, [(1, s) for s in range(6)] + [(250, 2)],
                                 [(300, 5)], [(9, -1), (280, 0)]]):
        ts = _segment_slots(runs, seed)
        meta = build_meta(ts, 6)
        slot, start, rows = build_tiles(meta, block_m).cpu().tolist()
        assert len(rows) == tiles_bound(ts.shape[0], 6, block_m)
        sorted_slots = meta.sorted_slots.cpu().tolist()
        covered = []
        for sl, st, n in zip(slot, start, rows):
            assert 0 <= n <= block_m
            if n == 0:
                assert (sl, st) == (-1, 0)
                continue
            assert sorted_slots[st:st + n] == [sl] * n
            covered += range(st, st + n)
        assert sorted(covered) == [p for p, sl in enumerate(sorted_slots) if sl >= 0]
        live = [n > 0 for n in rows]
        assert live == sorted(live, reverse=True), "tiles first, then padding"


@pytest.mark.parametrize("R,split_k", [(32, 1), (32, 3), (64, 2)])
def test_segment_kernels_split_k_slice_groups_and_chunks(R, split_k):
    """The two prefill kernels alone, with small blocks so that every program loops: K in
    steps of 16 over 1-3 splits, rank 64 x 3 slices in two slice groups, expand chunks of
    two 16-column tiles (slices end inside a chunk), and the partials summed by the expand."""
    offsets = SLICES[3]
    a, b, ranks = _pool(3, offsets, [8, R, 16, 4, R - 3], torch.float32, R=R, seed=R)
    ts = _segment_slots(PREFILL_RUNS[:3] + [(20, -1), (30, 4)], seed=R)
    x, y = _inputs(ts.shape[0], offsets[-1], torch.float32, seed=R)
    meta, valid = build_meta(ts, a.shape[0]), ts >= 0
    hp = seg_shrink(x, a, meta, ranks, block_m=16, split_k=split_k, block_k=16)
    assert hp.shape == (split_k, 3, ts.shape[0], R)
    want_h = lora_shrink_ref(x, a, ts)
    torch.testing.assert_close(hp.sum(0)[:, valid], want_h[:, valid], atol=1e-5, rtol=1e-5)
    want = lora_expand_ref(want_h, b, ts, offsets, y.clone())
    got = seg_expand(hp, b, y.clone(), meta, offsets, ranks, block_m=32, block_n=16, n_loop=2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[~valid], y[~valid])


def test_ranks_stop_the_work_at_the_slot_rank():
    """Junk past a slot's rank must not be read when ranks are given (proves the mask)."""
    offsets = SLICES[1]
    a, b, ranks = _pool(1, offsets, [8, 16], torch.float32, seed=4)
    clean_a, clean_b = a.clone(), b.clone()
    a[0, :, 8:] = 7.0
    b[0, :, 8:] = -3.0
    for T in (5, 30, 260):       # token path (one and two groups), prefill path
        ts = torch.arange(T, device=DEV) % 2
        x, y = _inputs(T, offsets[-1], torch.float32, seed=T)
        want = add_lora_ref(y.clone(), x, clean_a, clean_b, ts, offsets)
        got = add_lora(y.clone(), x, a, b, ts, offsets, ranks=ranks)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [24, 270])
def test_meta_reused_across_layers_and_strided_views(T):
    """One meta per step serves layers of different shapes (token and prefill paths); y may
    be a view into a wider output (columns of a fused projection) and x a strided view."""
    ts = _slots(T, 4, "random", seed=2)
    meta = build_meta(ts, 4)
    for S, seed in ((3, 1), (1, 2)):
        offsets = SLICES[S]
        a, b, ranks = _pool(S, offsets, [8, 16, 32, 4], torch.float32, seed=seed)
        g = torch.Generator().manual_seed(seed)
        wide_x = torch.randn(T, 2 * K_IN, generator=g).to(DEV)
        wide_y = torch.randn(T, offsets[-1] + 10, generator=g).to(DEV)
        x, y = wide_x[:, ::2], wide_y[:, 5:5 + offsets[-1]]
        want = add_lora_ref(y.clone(), x, a, b, ts, offsets)
        before = wide_y.clone()
        add_lora(y, x, a, b, ts, offsets, ranks=ranks, meta=meta)
        torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(wide_y[:, :5], before[:, :5])
        assert torch.equal(wide_y[:, 5 + offsets[-1]:], before[:, 5 + offsets[-1]:])


def test_no_adapter_batch_leaves_y_untouched():
    offsets = SLICES[2]
    a, b, _ = _pool(2, offsets, [8, 8], torch.float32)
    for T in (3, 20):
        x, y = _inputs(T, offsets[-1], torch.float32, seed=T)
        got = add_lora(y.clone(), x, a, b, torch.full((T,), -1, device=DEV), offsets)
        assert torch.equal(got, y)


def test_bad_shapes_raise_precise_errors():
    offsets = SLICES[2]
    a, b, _ = _pool(2, offsets, [8, 8], torch.float32)
    x, y = _inputs(4, offsets[-1], torch.float32, seed=0)
    ts = torch.zeros(4, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="slice_offsets"):
        add_lora(y, x, a, b, ts, (0, 72))
    with pytest.raises(ValueError, match="y has shape"):
        add_lora(y[:, :10], x, a, b, ts, offsets)
    with pytest.raises(ValueError, match="width"):
        add_lora(y, x[:, :10], a, b, ts, offsets)
    with pytest.raises(ValueError, match="meta was built"):
        add_lora(y, x, a, b, ts, offsets, meta=build_meta(ts[:3], 2))


def test_bench_floor_arithmetic():
    """The benchmark script imports without a GPU and its floor bytes follow PERF.md."""
    bench = importlib.import_module("benchmarks.bench_kernels")
    M, K, S, r, L, N = 16, 4096, 3, 16, 8, (4096, 1024, 1024)
    assert bench.shrink_floor_bytes(M, K, S, r, L) == M * K * 2 + L * S * r * K * 2 + S * M * r * 4
    assert bench.expand_floor_bytes(M, N, r, L) == (len(N) * M * r * 4 + L * sum(N) * r * 2
                                                   + 2 * M * sum(N) * 2)
    mapping = bench.token_slots_for(64, 8, "contiguous", torch.device("cpu"))
    assert mapping.shape == (64,) and set(mapping.tolist()) == set(range(8))
    assert (mapping.diff() >= 0).all()
    assert len(bench.layer_groups()) == 4


@pytest.mark.parametrize("module", [mixed_kernels, segment, token],
                         ids=lambda m: m.__name__)
def test_kernels_run_as_this_machine_needs(module):
    """Interpreted on the CPU (so the other tests here run the Triton kernels, not only the
    references), compiled on CUDA."""
    check_kernel_mode(module)
