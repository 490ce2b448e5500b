"""The add + RMSNorm + LoRA shrink launch (kernels/lora/norm_shrink.py), the SiLU-and-
multiply + shrink launch (kernels/lora/silu_shrink.py) and the expand that finishes
either, against the torch references (kernels/lora/reference.py): fresh random activations,
residuals, norm weights, A and B; widths that are not powers of two, ranks below the
pool's, one to three slices, split-K; one adapter, one adapter with base rows, no
adapter, and mixed adapters per row. Under the Triton interpreter without a GPU
(tests/conftest.py), compiled with one."""
from __future__ import annotations

import pytest
import torch

from loramux_kernels import lora as lora_kernels
from loramux_kernels.lora import norm_shrink, silu_shrink
from loramux_kernels.lora.launch import build_meta
from loramux_kernels.lora.norm_shrink import add_rms_norm_shrink, expand_fused_shrunk, fits
from loramux_kernels.lora.reference import (add_lora_ref, add_rms_norm_shrink_ref,
                                            silu_mul_shrink_ref)
from loramux_kernels.lora.silu_shrink import silu_mul_shrink
from tests.support.lora_pool import slot_pool
from tests.support.triton_mode import check_kernel_mode

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5
SLICES = {1: (0, 72), 2: (0, 40, 80), 3: (0, 96, 120, 144)}
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=6e-2, rtol=3e-2)}


def _slots(case: str, T: int, L: int, g: torch.Generator) -> torch.Tensor:
    one = int(torch.randint(0, L, (1,), generator=g))
    return {"one": torch.full((T,), one),
            "one_some_base": torch.where(torch.rand(T, generator=g) < 0.3, -1, one),
            "all_base": torch.full((T,), -1),
            "mixed": torch.randint(-1, L, (T,), generator=g)}[case].to(DEV)


def _check_expand(shrunk, a, b, ts, offsets, y, lora_in, tol):
    """The expand that finishes a fused shrink (expand_fused_shrunk) adds to y what
    add_lora_ref adds for the layer input `lora_in` (the reference norm's or activation's
    output), nothing to base rows, and something that shows when any row has an adapter."""
    with_slot = ts >= 0
    got = expand_fused_shrunk(shrunk, b, y.clone(), build_meta(ts, a.shape[0]))
    want = add_lora_ref(y.clone(), lora_in, a, b, ts, offsets)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got[~with_slot], y[~with_slot]), "base rows must get nothing"
    if with_slot.any():
        assert (want - y).abs().max() > 0.1, "the adapters really contribute"


def _check(T, N, S, R, ranks, case, dtype, has_add=True, splits=None, seed=0, uniform=None):
    """uniform: the hint (row blocks or one row per shrink program); default: whether the
    case has one adapter."""
    g = torch.Generator().manual_seed(seed)
    offsets = SLICES[S]
    a, b, ranks_t = slot_pool(S, offsets, ranks, N, dtype, DEV, R, seed)
    ts = _slots(case, T, len(ranks), g)
    x = (torch.randn(T, N, generator=g) * 2).to(DEV, dtype) if has_add else None
    res = (torch.randn(T, N, generator=g) * 3).to(DEV, dtype)
    w = (1 + torch.randn(N, generator=g) / 4).to(DEV, dtype)
    y = torch.randn(T, offsets[-1], generator=g).to(DEV, dtype)
    res_before = res.clone()
    want_out, want_res, want_h = add_rms_norm_shrink_ref(x, res, w, EPS, a, ts)
    out, new_res, shrunk = add_rms_norm_shrink(x, res, w, EPS, a, ts, offsets, ranks_t,
                                               uniform=case.startswith("one")
                                               if uniform is None else uniform, splits=splits)
    tol = TOL[dtype]
    torch.testing.assert_close(out, want_out, **tol)
    torch.testing.assert_close(new_res, want_res, **tol)
    assert torch.equal(res, res_before), "the old residual is read, never written"
    with_slot = ts >= 0
    h = shrunk.hp.sum(0) * shrunk.rstd[None, :, None]
    torch.testing.assert_close(h[:, with_slot], want_h[:, with_slot], **tol)
    _check_expand(shrunk, a, b, ts, offsets, y, want_out, tol)


def test_kernels_run_in_the_expected_mode():
    check_kernel_mode(norm_shrink)


@pytest.mark.parametrize("case", ["one", "one_some_base", "mixed"])
@pytest.mark.parametrize("T,N,S", [(1, 200, 3), (5, 96, 2), (19, 600, 3), (16, 136, 1)])
def test_matches_reference(case, T, N, S):
    _check(T, N, S, 16, [8, 16, 4, 12], case, torch.float32, seed=T * N + S)


@pytest.mark.parametrize("case,uniform", [("mixed", True), ("one_some_base", False)])
def test_a_wrong_hint_changes_nothing(case, uniform):
    """Row blocks over several adapters (one pass each), one-row programs on one adapter."""
    _check(21, 200, 3, 16, [8, 16, 4, 12], case, torch.float32, seed=21, uniform=uniform)


@pytest.mark.parametrize("R,ranks", [(8, [8, 2, 5]), (32, [32, 20, 7])])
def test_other_pool_ranks(R, ranks):
    _check(7, 160, 3, R, ranks, "mixed", torch.float32, seed=R)


@pytest.mark.parametrize("case", ["one", "mixed"])
def test_the_widest_fused_group(case):
    """q/k/v at rank 128 in float32: the widest A tile a fused program takes (S·R = 384,
    512 columns), which must still fit one program's shared memory on a GPU."""
    assert fits(3, 128) and fits(1, 512)
    _check(5, 136, 3, 128, [128, 40], case, torch.float32, seed=128)


def test_wider_groups_take_the_plain_op():
    """q/k/v at rank 256 (a 1,024-column tile: 262 KB of shared memory in float32 on
    sm_90, more than there is) is not fused: the dispatcher answers None, and the engine
    runs the plain norm and the token shrink."""
    assert not fits(3, 256) and not fits(2, 512) and not fits(1, 1024)
    g = torch.Generator().manual_seed(5)
    a, _, ranks = slot_pool(3, SLICES[3], [256, 16], 136, torch.float32, DEV, 256, 5)
    res = torch.randn(4, 136, generator=g).to(DEV)
    w = torch.ones(136, device=DEV)
    ts = torch.tensor([0, 1, -1, 0], device=DEV)
    assert lora_kernels.norm_shrink_ahead(None, res, w, EPS, a, ts, SLICES[3], ranks) is None
    a1, _, ranks1 = slot_pool(1, (0, 72), [256, 16], 68, torch.float32, DEV, 1024, 6)
    gate_up = torch.randn(4, 136, generator=g).to(DEV)
    assert lora_kernels.silu_shrink_ahead(gate_up, a1, ts, (0, 72), ranks1) is None


def test_no_adapter_rows_only():
    _check(6, 96, 2, 16, [8, 16], "all_base", torch.float32, seed=3)


@pytest.mark.parametrize("splits", [1, 5])
def test_given_split_k(splits):
    _check(18, 600, 2, 16, [16, 12, 8], "one_some_base", torch.float32, splits=splits,
           seed=splits)


def test_first_layer_norms_the_residual_as_it_is():
    """No x (the embedding starts the residual stream): nothing is added or written."""
    _check(5, 200, 3, 16, [8, 16, 4], "mixed", torch.float32, has_add=False, seed=9)


@pytest.mark.parametrize("case", ["one", "mixed"])
def test_bfloat16(case):
    _check(9, 264, 3, 16, [16, 8, 12], case, torch.bfloat16, seed=11)


def _check_silu(T, I, R, ranks, case, dtype, splits=None, seed=0, uniform=None):
    """The SiLU-and-multiply + shrink launch (kernels/lora/silu_shrink.py) against
    silu_mul_shrink_ref, then its expand against add_lora_ref on the reference rows."""
    g = torch.Generator().manual_seed(seed)
    offsets = (0, 80)
    a, b, ranks_t = slot_pool(1, offsets, ranks, I, dtype, DEV, R, seed)
    ts = _slots(case, T, len(ranks), g)
    x = (torch.randn(T, 2 * I, generator=g) * 2).to(DEV, dtype)
    y = torch.randn(T, offsets[-1], generator=g).to(DEV, dtype)
    want_out, want_h = silu_mul_shrink_ref(x, a, ts)
    out, shrunk = silu_mul_shrink(x, a, ts, offsets, ranks_t, splits=splits,
                                  uniform=case.startswith("one") if uniform is None else uniform)
    tol = TOL[dtype]
    torch.testing.assert_close(out, want_out, **tol)
    with_slot = ts >= 0
    torch.testing.assert_close(shrunk.hp.sum(0)[:, with_slot], want_h[:, with_slot], **tol)
    _check_expand(shrunk, a, b, ts, offsets, y, want_out, tol)


def test_silu_kernels_run_in_the_expected_mode():
    check_kernel_mode(silu_shrink)


@pytest.mark.parametrize("case", ["one", "one_some_base", "mixed", "all_base"])
@pytest.mark.parametrize("T,I", [(1, 200), (19, 136)])
def test_silu_shrink_matches_reference(case, T, I):
    _check_silu(T, I, 16, [8, 16, 4, 12], case, torch.float32, seed=T + I)


@pytest.mark.parametrize("case,uniform,splits", [("mixed", True, 3), ("one", False, None),
                                                 ("one_some_base", True, 1)])
def test_silu_shrink_hint_and_split(case, uniform, splits):
    _check_silu(18, 600, 32, [32, 20, 7], case, torch.float32, splits, seed=5, uniform=uniform)


@pytest.mark.parametrize("case", ["one", "mixed"])
def test_silu_shrink_bfloat16(case):
    _check_silu(9, 264, 16, [16, 8, 12], case, torch.bfloat16, seed=13)


@pytest.mark.parametrize("setting,uniform_step,mixed_step", [
    ("off", False, False), ("uniform", True, False), ("mixed", False, True), ("all", True, True)])
def test_each_setting_fuses_its_steps(setting, uniform_step, mixed_step, monkeypatch):
    """FUSED_NORM_SHRINK / FUSED_SILU_SHRINK: "uniform" fuses the steps whose rows share one
    adapter, "mixed" the others, "all" both, "off" none; a LoRABatch reads them once."""
    from loramux_engine.lora import batch as batch_module
    assert set(batch_module.NORM_SHRINK_MODES) == {"off", "uniform", "mixed", "all"}
    assert batch_module.FUSED_NORM_SHRINK in batch_module.NORM_SHRINK_MODES
    assert batch_module.FUSED_SILU_SHRINK in batch_module.NORM_SHRINK_MODES
    assert batch_module._fuses(setting, True) is uniform_step
    assert batch_module._fuses(setting, False) is mixed_step
