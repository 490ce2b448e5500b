"""The one-launch LoRA kernel (kernels/lora_uniform_triton.py, what `add_lora(uniform=True)`
runs up to 256 tokens) against the torch reference (kernels/lora_ref.py).

Fresh random inputs and random B, ranks below the pool's max rank, one to four slices of
unequal widths, split-K and several output tiles per slice; rows without an adapter inside
a "uniform" batch, and batches the hint is wrong about (several adapters): the hint never
changes the result. Runs under the Triton interpreter without a GPU (tests/conftest.py).
"""
from __future__ import annotations

import pytest
import torch

from kernels import lora_triton, lora_uniform_kernels_triton, lora_uniform_triton
from kernels.lora_ref import add_lora_ref
from kernels.lora_triton import add_lora, build_meta
from kernels.lora_uniform_triton import (add_lora_uniform, launch_shape, uniform_expand,
                                         uniform_shrink)
from tests.support.lora_pool import slot_pool
from tests.support.triton_mode import check_kernel_mode

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def one_launch(monkeypatch):
    """add_lora(uniform=True) takes the one-launch kernel here (it is not the default)."""
    monkeypatch.setattr(lora_triton, "UNIFORM_ONE_LAUNCH", True)
TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=6e-2, rtol=3e-2)}
# unequal widths; the first slice needs two 256-column tiles (q/k/v-like under GQA)
SLICES = {1: (0, 300), 2: (0, 80, 160), 3: (0, 300, 364, 428), 4: (0, 40, 72, 72, 136)}
K_IN = 600          # several split-K chunks at every row block size
RANKS = [8, 16, 4, 12, 16]   # below the pool's rank 16 except one; slot 4 stays unused


def _pool(S, offsets, dtype, seed, R=16, ranks=RANKS):
    """Slot pool, weights past a slot's rank zero (as loaded); random A and B."""
    return slot_pool(S, offsets, ranks, K_IN, dtype, DEV, R, seed)


def _slots(case: str, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    one = int(torch.randint(0, 4, (1,), generator=g))
    ts = {"one": torch.full((T,), one),
          # a padded bucket and base requests between the adapter's rows
          "one_some_base": torch.where(torch.rand(T, generator=g) < 0.3, -1, one),
          "all_base": torch.full((T,), -1),
          # the hint is wrong: several adapters, runs and scattered rows
          "mixed": torch.randint(-1, 4, (T,), generator=g)}[case]
    return ts.to(DEV)


def _inputs(T, N, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K_IN, generator=g).to(DEV, dtype)
    y = torch.randn(T, N, generator=g).to(DEV, dtype)   # added into a random y
    return x, y


def _check(T, S, case, dtype, seed):
    offsets = SLICES[S]
    a, b, ranks = _pool(S, offsets, dtype, seed)
    ts = _slots(case, T, seed + 1)
    x, y = _inputs(T, offsets[-1], dtype, seed + 2)
    want = add_lora_ref(y.clone(), x, a, b, ts, offsets)
    got = add_lora(y.clone(), x, a, b, ts, offsets, ranks=ranks, uniform=True)
    torch.testing.assert_close(got, want, **TOL[dtype])
    base = ts < 0
    assert torch.equal(got[base], y[base]), "rows without an adapter must be untouched"
    counters = lora_uniform_triton._sync_counters(torch.device(DEV))
    assert counters.tolist() == [0, 0], "the launch must leave its counters at zero"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S", [1, 2, 3, 4])
@pytest.mark.parametrize("T", [1, 8, 16, 64])
@pytest.mark.parametrize("case", ["one", "one_some_base"])
def test_one_adapter_batches_match_reference(dtype, S, T, case):
    _check(T, S, case, dtype, seed=T * 10 + S)


@pytest.mark.parametrize("T,S,case", [(8, 3, "mixed"), (37, 2, "mixed"), (64, 4, "mixed"),
                                      (16, 3, "all_base"), (256, 3, "one_some_base"),
                                      (256, 1, "mixed"), (100, 2, "one")])
def test_other_batches_and_sizes_match_reference(T, S, case):
    """A wrong hint (several adapters per row block), no adapter at all, and the largest
    token count (four row blocks): still the reference's result."""
    _check(T, S, case, torch.float32, seed=T + S)


@pytest.mark.parametrize("T", [8, 64])
def test_high_rank_pool_matches_reference(T):
    """A rank-64 pool (narrower tiles) with adapters of lower ranks in it."""
    offsets = SLICES[3]
    a, b, ranks = _pool(3, offsets, torch.float32, seed=T, R=64, ranks=[8, 48, 64, 33, 16])
    ts = _slots("mixed" if T == 8 else "one_some_base", T, seed=T)
    x, y = _inputs(T, offsets[-1], torch.float32, seed=T + 1)
    want = add_lora_ref(y.clone(), x, a, b, ts, offsets)
    got = add_lora(y.clone(), x, a, b, ts, offsets, ranks=ranks, uniform=True)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_expand_programs_loop_over_tiles(monkeypatch):
    """A small GPU (few programs held at once): each expand program takes several tiles,
    across slices and row blocks."""
    monkeypatch.setattr(lora_uniform_triton, "_resident_programs", lambda device: 12)
    shape = launch_shape(100, 3, K_IN, SLICES[3], 12)
    assert shape.n_expand < shape.cum_tiles[3] * 2, shape
    for case in ("one_some_base", "mixed"):
        _check(100, 3, case, torch.float32, seed=5)


@pytest.mark.parametrize("T,S,case", [(1, 3, "one"), (16, 2, "one_some_base"),
                                      (64, 4, "mixed"), (100, 1, "one_some_base")])
def test_shrink_and_expand_as_two_launches(T, S, case):
    """The halves launched apart (the shrink may run beside the base matmul): the same
    result, and the one-launch counters untouched."""
    offsets = SLICES[S]
    a, b, ranks = _pool(S, offsets, torch.float32, seed=T + 7)
    ts = _slots(case, T, seed=T + 8)
    x, y = _inputs(T, offsets[-1], torch.float32, seed=T + 9)
    want = add_lora_ref(y.clone(), x, a, b, ts, offsets)
    got = uniform_expand(uniform_shrink(x, a, ts, offsets, ranks), b, y.clone())
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert torch.equal(got[ts < 0], y[ts < 0])
    assert lora_uniform_triton._sync_counters(torch.device(DEV)).tolist() == [0, 0]


@pytest.mark.parametrize("one", [False, True])
@pytest.mark.parametrize("T,case", [(1, "one"), (64, "one_some_base"), (37, "mixed")])
def test_shrink_ahead_then_expand(monkeypatch, one, T, case):
    """kernels.lora_triton.shrink_ahead / expand_after, the halves the engine launches
    apart (shrink beside the base matmul): the token kernels' (the default) or, with
    UNIFORM_ONE_LAUNCH, the one-launch kernel's; the reference's result either way."""
    monkeypatch.setattr(lora_triton, "UNIFORM_ONE_LAUNCH", one)
    offsets = SLICES[3]
    a, b, ranks = _pool(3, offsets, torch.float32, seed=T + 3)
    ts = _slots(case, T, seed=T + 4)
    x, y = _inputs(T, offsets[-1], torch.float32, seed=T + 5)
    want = add_lora_ref(y.clone(), x, a, b, ts, offsets)
    shrunk = lora_triton.shrink_ahead(x, a, ts, offsets, ranks, None)
    assert shrunk[0] == ("one" if one else "tok")
    got = lora_triton.expand_after(shrunk, b, y.clone())
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert torch.equal(got[ts < 0], y[ts < 0])


def test_uniform_hint_result_equals_two_launch_path():
    """One launch and the two-launch token path agree (float32, to rounding)."""
    offsets = SLICES[3]
    a, b, ranks = _pool(3, offsets, torch.float32, seed=3)
    ts = _slots("one_some_base", 64, seed=4)
    x, y = _inputs(64, offsets[-1], torch.float32, seed=5)
    meta = build_meta(ts, a.shape[0])
    one = add_lora_uniform(y.clone(), x, a, b, ts, offsets, ranks)
    two = lora_triton.add_lora_tokens(y.clone(), x, a, b, meta, offsets, ranks, uniform=False)
    torch.testing.assert_close(one, two, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("resident", [264, 16])
def test_launch_shape_covers_every_chunk_and_tile(resident):
    """Llama-3-8B groups, their TP=2 shards and the tests' shapes, every token count: the K
    chunks tile K exactly, no expand program is without a tile, and the grid stays within
    what the GPU holds at once where that allows one program per role."""
    groups = [(4096, (0, 4096, 5120, 6144)), (4096, (0, 4096)), (4096, (0, 14336, 28672)),
              (14336, (0, 4096)), (2048, (0, 2048, 2560, 3072)), (7168, (0, 4096)),
              (K_IN, SLICES[4])]
    for T, R in [(t, 16) for t in range(1, 257)] + [(t, r) for t in (1, 64, 256)
                                                    for r in (8, 64, 128, 256)]:
        for Kdim, offsets in groups:
            S = len(offsets) - 1
            sh = launch_shape(T, S, Kdim, offsets, resident, R)
            assert sh.block_k * max(16, R) <= 8192 and sh.block_n * max(16, R) <= 8192
            assert sh.k_chunk % sh.block_k == 0 and sh.split_k <= 16
            assert (sh.split_k - 1) * sh.k_chunk < Kdim <= sh.split_k * sh.k_chunk, (T, Kdim)
            m_blocks = -(-T // sh.block_m)
            assert sh.n_shrink == m_blocks * S * sh.split_k
            assert 1 <= sh.n_expand <= m_blocks * sh.cum_tiles[3], (T, offsets)
            if m_blocks * S < resident // 2:
                assert sum(sh.grid) <= resident, (T, Kdim, offsets, sh)


def test_kernel_runs_as_this_machine_needs():
    """Interpreted on the CPU (the tests above run the Triton kernel), compiled on CUDA."""
    check_kernel_mode(lora_uniform_kernels_triton)


def test_bench_times_both_uniform_paths_side_by_side():
    """bench_kernels --uniform / --targets: every one-adapter decode case on both paths;
    the path switch holds inside its block only."""
    import importlib
    bench = importlib.import_module("benchmarks.bench_kernels")
    for kw, paths in ((dict(quick=False, uniform=True), bench.UNIFORM_PATHS + (bench.AHEAD,)),
                      (dict(quick=False, targets=True), bench.UNIFORM_PATHS)):
        one = [c for c in bench.cases(**kw) if c.adapters == 1 and c.tokens <= 256]
        assert one and {c.path for c in one} == set(paths)
        assert len(one) == len(paths) * len({(c.group, c.tokens) for c in one})
    assert all(c.path not in bench.UNIFORM_PATHS
               for c in bench.cases(False, targets=True) if c.adapters > 1)
    with bench.uniform_path("two-launch"):
        assert lora_triton.UNIFORM_ONE_LAUNCH is False
    assert lora_triton.UNIFORM_ONE_LAUNCH is True


def test_uniform_steps_need_no_metadata(monkeypatch):
    """The one-launch path reads token_slots as they are: a uniform step up to 256 tokens
    builds no LoRAMeta (no sort in the step); the other paths still do."""
    assert not lora_triton.uses_meta(1, True) and not lora_triton.uses_meta(256, True)
    assert lora_triton.uses_meta(257, True) and lora_triton.uses_meta(64, False)
    monkeypatch.setattr(lora_triton, "ONE_LAUNCH_MAX_TOKENS", 16)
    assert not lora_triton.uses_meta(16, True) and lora_triton.uses_meta(17, True)
    monkeypatch.setattr(lora_triton, "UNIFORM_ONE_LAUNCH", False)
    assert lora_triton.uses_meta(64, True)


def test_bench_decode_switches_the_uniform_path(monkeypatch):
    """bench_decode's modes one-split / one-ahead set the two switches and drop the captured
    graphs when they change; other modes restore the defaults."""
    import importlib
    from types import SimpleNamespace

    from engine.lora import batch as batch_module
    bench = importlib.import_module("benchmarks.bench_decode")
    monkeypatch.setattr(bench, "_DEFAULT_PATH", {})
    monkeypatch.setattr(lora_triton, "UNIFORM_ONE_LAUNCH", False)
    monkeypatch.setattr(batch_module, "SHRINK_AHEAD", False)
    released = []
    eng = SimpleNamespace(runner=SimpleNamespace(
        graphs=SimpleNamespace(release=lambda: released.append(1))))
    for mode, want, n_released in (("one", (False, False), 0), ("one-split", (False, False), 0),
                                   ("one-launch", (True, False), 1),
                                   ("one-ahead", (False, True), 2), ("base", (False, False), 3),
                                   ("distinct", (False, False), 3)):
        bench.select_uniform_path(eng, mode)
        assert (lora_triton.UNIFORM_ONE_LAUNCH, batch_module.SHRINK_AHEAD) == want, mode
        assert len(released) == n_released, mode
