"""The mixed-adapter decode kernels (kernels/lora/mixed.py: tiles of slot segments)
against the torch reference (kernels/lora/reference.py), on fresh random inputs and random
B, and the planner's choice between them and the token kernels (kernels/lora/plan.py).

Interpreted on the CPU (tests/conftest.py sets TRITON_INTERPRET), compiled on CUDA.
Shapes are small (K 48, slices of 16-40 columns) so that the interpreter stays quick, with
narrow column tiles and tiny K tiles so every program loops."""
from __future__ import annotations

import importlib

import pytest
import torch

from loramux_engine.lora.batch import spread_over_adapters
from loramux_kernels.lora import launch, mixed, mixed_kernels, plan
from loramux_kernels.lora.launch import add_lora, build_meta
from loramux_kernels.lora.mixed import PARAMS, SEGMENTS, MixedParams, add_lora_mixed
from loramux_kernels.lora.plan import (MIXED, TOKEN_PATH_MAX_TOKENS, TOKENS, min_rows,
                                       shape_class)
from loramux_kernels.lora.reference import add_lora_ref, lora_shrink_ref
from tests.support.triton_mode import check_kernel_mode
from tests.test_kernels_lora import DEV, SLICES, TOL, _inputs, _pool

RANKS = [8, 32, 16, 4, 16, 32, 12, 1]      # below and at the pool's max rank 32
SMALL = dict(block_n=16, block_k=16)     # several column and K tiles per program


def _mapping(kind: str, T: int, L: int, seed: int) -> torch.Tensor:
    """T tokens over L slots: random with no-adapter rows, round robin (T // L rows per
    adapter, as a decode batch of many requests per adapter), runs of one slot, or one."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        ts = torch.randint(-1, L, (T,), generator=g)
    elif kind == "round_robin":
        ts = torch.arange(T) % L
        ts[torch.rand(T, generator=g) < 0.1] = -1
    elif kind == "runs":
        ts = (torch.arange(T) * 3 // max(T, 1)) % L
    else:
        ts = torch.full((T,), L - 1)
    return ts.to(DEV)


def _check(T, S, kind, params, dtype=torch.float32, seed=0):
    offsets = SLICES[S]
    a, b, ranks = _pool(S, offsets, RANKS, dtype, seed=seed + T + S)
    ts = _mapping(kind, T, a.shape[0], seed=seed + T)
    x, y = _inputs(T, offsets[-1], dtype, seed=seed + T + 7)
    meta = build_meta(ts, a.shape[0])
    want = add_lora_ref(y.clone(), x, a, b, ts, offsets)
    got = add_lora_mixed(y.clone(), x, a, b, meta, offsets, ranks, params)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got[ts < 0], y[ts < 0]), "tokens without an adapter must be untouched"
    return got


@pytest.mark.parametrize("T", [1, 16, 64, 65, 128, 256])
@pytest.mark.parametrize("S", [1, 2, 3])
def test_mixed_matches_reference(T, S):
    """Every token count of the decode path, one to three slices, random mapping with
    no-adapter rows, split-K partials summed by the shrink."""
    _check(T, S, "random", MixedParams(programs=7, split_k=3, tpp=2, **SMALL), seed=1)


@pytest.mark.parametrize("T,kind", [(16, "round_robin"), (65, "runs"), (128, "round_robin"),
                                    (256, "round_robin"), (64, "one"), (37, "runs")])
@pytest.mark.parametrize("block_m,reduce,programs", [(16, True, 0), (16, False, 5),
                                                     (32, True, 2)])
def test_mixed_rows_per_adapter_and_tiles(T, kind, block_m, reduce, programs):
    """Several rows per adapter (a segment longer than a tile: several tiles of one slot),
    partials summed by the shrink or by the expand, 16- and 32-row tiles, fewer programs
    than tiles (each loops over several)."""
    _check(T, 3, kind, MixedParams(block_m=block_m, programs=programs, split_k=2,
                                   reduce=reduce, tpp=3, **SMALL), seed=2)


@pytest.mark.parametrize("T,S", [(64, 3), (128, 2), (256, 1)])
def test_mixed_bfloat16(T, S):
    _check(T, S, "round_robin", MixedParams(split_k=2, **SMALL), dtype=torch.bfloat16, seed=3)


def test_mixed_automatic_parameters_and_dispatch():
    """add_lora sends mixed batches above 64 tokens here on the default table (the CPU's),
    with split-K and columns per program sized from the shape; one adapter for the whole
    batch (the `uniform` hint) and 64 tokens keep the token kernels."""
    offsets = SLICES[2]
    a, b, ranks = _pool(2, offsets, RANKS, torch.float32, seed=4)
    x, y = _inputs(100, offsets[-1], torch.float32, seed=4)
    for T, want in ((100, MIXED), (64, TOKENS)):
        assert plan.choose(x.device, T, False, False, 2, x.shape[1], 40, a.shape[2]) == want
    ts = _mapping("round_robin", 100, a.shape[0], seed=4)
    want = add_lora_ref(y.clone(), x, a, b, ts, offsets)
    torch.testing.assert_close(add_lora(y.clone(), x, a, b, ts, offsets, ranks=ranks), want,
                               **TOL[torch.float32])
    launch_plan = mixed._plan(x.device, 100, a.shape[0], offsets, a.shape[2], x.shape[1], None)
    assert launch_plan.split_k >= 1 and launch_plan.tpp >= 1
    assert 1 <= launch_plan.programs <= launch_plan.tiles


def _spy_segments(monkeypatch) -> list:
    """Records each add_lora_mixed call (the segment kernels) that add_lora makes."""
    calls, real = [], mixed.add_lora_mixed

    def spy(*args, **kwargs):
        calls.append(args[1].shape[0])
        return real(*args, **kwargs)
    monkeypatch.setattr(mixed, "add_lora_mixed", spy)
    return calls


@pytest.mark.parametrize("seed,S", [(0, 3), (1, 1)])
def test_both_mixed_paths_match_reference(seed, S, monkeypatch):
    """A random batch of 65..160 tokens (the CPU's table: segment kernels) over a random
    number of adapters, some rows base: the rows-per-adapter rule on its host slot ids
    picks the path (spread: the token kernels), and either path gives the reference's
    sums (random B)."""
    g = torch.Generator().manual_seed(seed)
    T = int(torch.randint(65, 161, (1,), generator=g))
    ranks = torch.randint(1, 33, (40,), generator=g).tolist()
    offsets = SLICES[S]
    a, b, r = _pool(S, offsets, ranks, torch.float32, seed=seed)
    used = int(torch.randint(4, 41, (1,), generator=g))
    ts = torch.randperm(40, generator=g)[torch.randint(0, used, (T,), generator=g)]
    ts[torch.rand(T, generator=g) < 0.2] = -1
    x, y = _inputs(T, offsets[-1], torch.float32, seed=seed)
    want = add_lora_ref(y.clone(), x, a, b, ts.to(DEV), offsets)
    rule = spread_over_adapters(((s, 1) for s in ts.tolist()),
                                launch.mixed_min_rows("cpu", T))
    calls = _spy_segments(monkeypatch)
    for spread in (rule, not rule):
        got = add_lora(y.clone(), x, a, b, ts.to(DEV), offsets, ranks=r, spread=spread)
        torch.testing.assert_close(got, want, **TOL[torch.float32])
        assert torch.equal(got[ts < 0], y[ts < 0])
        assert len(calls) == (not spread), (T, used, spread)
        calls.clear()


def test_rows_per_adapter_rule_at_the_boundary(monkeypatch):
    """96 tokens (the CPU's rule: 4 rows per adapter) over 24 adapters stay on the segment
    kernels, over 25 take the token kernels; the same on the H100's table above 64
    tokens; "table" (the choice before the rule) keeps the segment kernels for both."""
    assert launch.mixed_min_rows("cpu", 96) == 4
    offsets = SLICES[1]
    a, b, r = _pool(1, offsets, [16] * 25, torch.float32, seed=11)
    x, y = _inputs(96, offsets[-1], torch.float32, seed=11)
    calls = _spy_segments(monkeypatch)
    for adapters, segments in ((24, True), (25, False)):
        ts = torch.arange(96) % adapters
        spread = spread_over_adapters(((s, 1) for s in ts.tolist()), 4)
        got = add_lora(y.clone(), x, a, b, ts.to(DEV), offsets, ranks=r, spread=spread)
        torch.testing.assert_close(got, add_lora_ref(y.clone(), x, a, b, ts.to(DEV), offsets),
                                   **TOL[torch.float32])
        assert bool(calls) == segments, adapters
        calls.clear()
        R = a.shape[2]
        assert (plan.choose(x.device, 96, False, spread, 1, x.shape[1], 48, R) == MIXED
                ) == segments
        monkeypatch.setattr(plan, "FORCED", "table")
        assert plan.choose(x.device, 96, False, spread, 1, x.shape[1], 48, R) == MIXED
        monkeypatch.setattr(plan, "FORCED", None)
    assert [min_rows("H100", t) for t in (1, 64, 65, 128, 256)] == [0, 0, 4, 4, 4]
    assert min_rows("H200", 200) == min_rows("H100", 200) and min_rows(None, 100) == 4
    assert launch.mixed_min_rows("cpu", 257) == 0     # the prefill path: no rule


def test_counters_reset_and_replay_gives_the_same_result():
    """The last arrival of each (tile, slice) resets its counter (the step's meta holds
    them): launches again (the next layer, a CUDA graph replay) find zeros and give the
    same sums."""
    offsets = SLICES[3]
    a, b, ranks = _pool(3, offsets, RANKS, torch.float32, seed=5)
    ts = _mapping("random", 70, a.shape[0], seed=5)
    x, y = _inputs(70, offsets[-1], torch.float32, seed=5)
    meta = build_meta(ts, a.shape[0])
    params = MixedParams(split_k=3, tpp=1, **SMALL)
    first = add_lora_mixed(y.clone(), x, a, b, meta, offsets, ranks, params)
    assert int(meta.counters.abs().sum()) == 0
    again = add_lora_mixed(y.clone(), x, a, b, meta, offsets, ranks, params)
    assert torch.equal(first, again)


def test_shrink_reduced_partials_match_reference():
    """hp[0] holds x·Aᵀ by sorted position after the shrink's reduction (the expand reads
    nothing else)."""
    offsets = SLICES[2]
    a, _, ranks = _pool(2, offsets, RANKS, torch.float32, seed=6)
    ts = _mapping("round_robin", 90, a.shape[0], seed=6)
    x, _ = _inputs(90, offsets[-1], torch.float32, seed=6)
    meta = build_meta(ts, a.shape[0])
    plan = mixed._plan(x.device, 90, a.shape[0], offsets, a.shape[2], x.shape[1],
                       MixedParams(split_k=4, **SMALL))
    assert plan.reduce and plan.split_k == 3     # 48 = 3 K tiles of 16: no empty split
    assert plan.k_chunk == 16
    hp = mixed.lora_shrink_mixed(x, a, meta, plan, ranks)
    n = int((ts >= 0).sum())
    want = lora_shrink_ref(x, a, ts)[:, meta.sorted_tokens[:n].long()]
    torch.testing.assert_close(hp[0, :, :n], want, atol=1e-5, rtol=1e-5)


def test_high_rank_pool_with_tiles_kept_small():
    """A rank-64 pool (BLOCK_R 64): K and column tiles shrink with the rank (about 16 KB
    per pipeline stage), the result stays the reference's."""
    offsets = SLICES[2]
    g = torch.Generator().manual_seed(9)
    a = (torch.randn(3, 2, 64, 96, generator=g) / 10).to(DEV)
    b = (torch.randn(3, offsets[-1], 64, generator=g) / 8).to(DEV)
    ranks = torch.tensor([64, 40, 3], dtype=torch.int32, device=DEV)
    for slot, r in enumerate(ranks.tolist()):
        a[slot, :, r:], b[slot, :, r:] = 0, 0
    ts = _mapping("round_robin", 66, 3, seed=9)
    g2 = torch.Generator().manual_seed(10)
    x = torch.randn(66, 96, generator=g2).to(DEV)
    y = torch.randn(66, offsets[-1], generator=g2).to(DEV)
    params = MixedParams(split_k=2, block_k=512, block_n=512)
    plan = mixed._plan(x.device, 66, 3, offsets, 64, 96, params)
    assert (plan.block_r, plan.block_k, plan.block_n) == (64, 128, 128)
    want = add_lora_ref(y.clone(), x, a, b, ts, offsets)
    got = add_lora_mixed(y.clone(), x, a, b, build_meta(ts, 3), offsets, ranks, params)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_junk_past_a_slots_rank_is_not_read():
    offsets = SLICES[1]
    a, b, ranks = _pool(1, offsets, [8, 16, 4], torch.float32, seed=7)
    clean_a, clean_b = a.clone(), b.clone()
    a[0, :, 8:], b[0, :, 8:] = 7.0, -3.0
    a[2, :, 4:], b[2, :, 4:] = -5.0, 2.0
    ts = _mapping("round_robin", 80, 3, seed=7)
    x, y = _inputs(80, offsets[-1], torch.float32, seed=7)
    want = add_lora_ref(y.clone(), x, clean_a, clean_b, ts, offsets)
    got = add_lora_mixed(y.clone(), x, a, b, build_meta(ts, 3), offsets, ranks,
                         MixedParams(split_k=2, **SMALL))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_no_adapter_rows_only():
    offsets = SLICES[2]
    a, b, ranks = _pool(2, offsets, RANKS, torch.float32, seed=8)
    x, y = _inputs(70, offsets[-1], torch.float32, seed=8)
    ts = torch.full((70,), -1, device=DEV)
    got = add_lora_mixed(y.clone(), x, a, b, build_meta(ts, a.shape[0]), offsets, ranks,
                         MixedParams(split_k=2, **SMALL))
    assert torch.equal(got, y)


def test_split_k_chunks_cover_k_with_none_empty():
    for Kdim in (48, 100, 4096, 14336, 2048, 7168):
        for split in range(1, 33):
            plan = mixed._plan(torch.device("cpu"), 128, 64, (0, 32), 16, Kdim,
                               MixedParams(split_k=split))
            c, n = plan.k_chunk, plan.split_k
            assert c % plan.block_k == 0 or n == 1, (Kdim, split)
            assert n * c >= Kdim and (n - 1) * c < Kdim and n <= split, (Kdim, split)


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_tile_bound_covers_every_mapping(block_m):
    """The grid's static tile count covers the tiles of any mapping: sum over segments of
    ceil(len / BLOCK_M) <= min(T, segments + T // BLOCK_M)."""
    g = torch.Generator().manual_seed(block_m)
    for T in list(range(1, 80)) + [127, 128, 129, 200, 255, 256]:
        for L in (1, 3, 64, 300):
            plan = mixed._plan(torch.device("cpu"), T, L, (0, 32), 16, 64,
                               MixedParams(block_m=block_m))
            for _ in range(5):
                ts = torch.randint(-1, L, (T,), generator=g)
                lens = torch.bincount(ts[ts >= 0], minlength=L)
                assert int(((lens + block_m - 1) // block_m).sum()) <= plan.tiles, (T, L)


def test_shape_classes_and_parameter_table():
    """The mixed kernels' own table (launch parameters by shape class); which calls take
    them is the planner's (tests/test_kernels_lora_plan.py)."""
    assert shape_class(1, 3, 4096, 4096) == (16, "qkv")
    assert shape_class(65, 1, 14336, 4096) == (128, "down")
    assert shape_class(256, 1, 4096, 4096) == (256, "o")
    assert shape_class(TOKEN_PATH_MAX_TOKENS, 2, 4096, 14336) == (256, "gate_up")
    assert mixed.lookup(None, (256, "qkv")) == SEGMENTS
    for cls in PARAMS["H100"]:
        assert mixed.lookup("H200", cls) == mixed.lookup("H100", cls)
    for rows in PARAMS.values():
        for (bucket, kind), p in rows.items():
            assert bucket in (16, 64, 128, 256) and kind in plan.KINDS and p.block_m in (16, 32, 64)
            assert min(p.programs, p.split_k, p.tpp) >= 0 and p.warps in (1, 2, 4, 8)


def test_kernels_run_as_this_machine_needs():
    check_kernel_mode(mixed_kernels)


def test_sweep_prints_rows_the_table_takes():
    """benchmarks/sweep_lora_mixed.py imports without a GPU and the rows it prints are
    Python that gives back its choices (the faster of the two paths: TOKENS for the
    planner's table, the MIXED entry's parameters for the mixed kernels' table)."""
    sweep = importlib.import_module("benchmarks.sweep_lora_mixed")
    best = MixedParams(split_k=4, reduce=False, block_n=64, tpp=2, warps=8, stages=2)
    lines = sweep.table_rows("H100", [((128, "qkv"), 30.0, 20.0, best),
                                      ((64, "down"), 10.0, 12.5, SEGMENTS)])
    rows = eval("{" + "\n".join(lines) + "}", {"MixedParams": MixedParams, "TOKENS": TOKENS})
    assert rows == {"H100": {(128, "qkv"): best, (64, "down"): TOKENS}}


def test_sweep_descends_to_the_fastest_right_choice(tmp_path, monkeypatch):
    """The sweep's whole flow on the interpreter with tiny groups: every candidate checked
    against the reference (run for real), timings stood in by a cost that is least at
    split_k 2, no reduction, tpp 1, 16 programs; made wrong (on purpose, here) at split_k
    2 with the reduction in the shrink, which must never be chosen: the row it prints is
    the fastest right choice."""
    sweep = importlib.import_module("benchmarks.sweep_lora_mixed")
    right_pair = sweep.segments_pair

    def pair(s, params):
        fn = right_pair(s, params)
        if params.split_k == 2 and params.reduce:
            return lambda: fn().add_(1.0)
        return fn
    monkeypatch.setattr(sweep, "segments_pair", pair)
    for name, values in (("SPLITS", [1, 2]), ("TPPS", [1, 2]), ("BLOCK_NS", [64]),
                         ("PROGRAMS", [16]), ("LAUNCH", [(8, 3)]), ("BLOCK_KS", [])):
        monkeypatch.setattr(sweep, name, values)      # fewer candidates: the interpreter

    def cost(calls, params):
        calls[0]()          # adds into the first set's y, as timing does
        if params is None:
            return 10.0
        return (0.5 + abs(params.split_k - 2) - 0.1 * params.reduce + abs(params.tpp - 1)
                + abs(params.programs - 16) / 16 + (params.warps != 4) + (params.block_n != 128)
                + (params.block_k != 256))
    setup = sweep.Setup(groups=(("o", 48, (48,)),), tokens=(20,), device=DEV,
                        dtype=torch.float32, timer=cost)
    lines = sweep.sweep(tmp_path, budget=600, slots=24, bw=3e12, gpu="H100", setup=setup)
    rows = eval("{" + "\n".join(lines) + "}", {"MixedParams": MixedParams, "TOKENS": TOKENS})
    best = rows["H100"][(64, "o")]
    assert isinstance(best, MixedParams)
    assert (best.split_k, best.reduce, best.tpp, best.programs) == (2, False, 1, 16)
    csv_text = (tmp_path / "sweep_mixed.csv").read_text()
    assert csv_text.count("\n") > 5 and "split_k=2, reduce=True" in csv_text
    assert ",inf," in csv_text                  # the wrong one: timed as never


def test_bench_times_old_and_new_paths_side_by_side():
    """bench_kernels --targets has 64/128/256 tokens over 64 adapters on both mixed paths,
    and each case's path switch reaches the dispatch."""
    bench = importlib.import_module("benchmarks.bench_kernels")
    mixed = {(c.tokens, c.path) for c in bench.cases(False, targets=True)
             if c.adapters == 64 and c.group == "down"}
    assert {(t, p) for t in (64, 128, 256) for p in bench.MIXED_PATHS} <= mixed
    offsets = SLICES[1]
    a, _, _ = _pool(1, offsets, RANKS, torch.float32)
    x, _ = _inputs(100, offsets[-1], torch.float32, seed=0)
    for path, want in (("tokens", TOKENS), ("segments", MIXED)):
        with bench.mixed_path(path):
            for T in (100, 30):
                assert plan.choose(x.device, T, False, False, 1, x.shape[1], 48, 32) == want
    assert plan.FORCED is None


def test_bench_decode_times_before_and_after_the_rule(monkeypatch):
    """bench_decode --mixed-paths: "table" (the choice before the rows-per-adapter rule)
    and "rule" set the kernels' switch and drop captured graphs when it changes; the graph
    it times for 256 distinct adapters is the spread one, for 64 adapters round robin not."""
    from types import SimpleNamespace

    from loramux_engine.cuda_graph import decode_buckets, graph_key
    bench = importlib.import_module("benchmarks.bench_decode")
    monkeypatch.setattr(plan, "FORCED", None)
    released = []
    eng = SimpleNamespace(runner=SimpleNamespace(
        graphs=SimpleNamespace(release=lambda: released.append(1))))
    for path, want, n_released in (("rule", None, 0), ("table", "table", 1),
                                   ("table", "table", 1), ("rule", None, 2)):
        bench.select_mixed_path(eng, path)
        assert (plan.FORCED, len(released)) == (want, n_released), path
    buckets = decode_buckets(256)
    min_rows = {b: launch.mixed_min_rows("cpu", b) for b in buckets}
    graphs = SimpleNamespace(key_for=lambda sched, greedy: graph_key(buckets, sched, greedy,
                                                                     min_rows),
                             graph_for=lambda key: key)
    names = [f"bench{i}" for i in range(256)]
    eng = SimpleNamespace(runner=SimpleNamespace(graphs=graphs),   # bench{i}: id i, slot i
                          registry=SimpleNamespace(resolve=lambda name: int(name[5:])),
                          slots=SimpleNamespace(slot_of=lambda aid: aid))
    distinct = bench.decode_graph(eng, bench.mode_adapters("distinct", 256, names))
    d64 = bench.decode_graph(eng, bench.mode_adapters("d64", 256, names))
    assert distinct[:5] == (256, True, True, False, True)
    assert d64[:5] == (256, True, True, False, False)
    assert (bench.mixed_label("d64", "rule"), bench.mixed_label("d64", "table")) == (
        "d64", "d64/mp-table")
