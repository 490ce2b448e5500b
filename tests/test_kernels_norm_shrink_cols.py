"""The add + RMSNorm that writes its LoRA shrink as extra columns
(kernels/lora/norm_shrink_cols.py) against the torch reference
(kernels/lora/reference.py add_rms_norm_shrink_cols_ref): fresh random activations,
residuals, norm weights and A; widths that are not powers of two, one to three slices,
ranks below the pool's (zero-padded columns), one adapter with base rows, no adapter,
mixed adapters; and [x | s] @ [W | B]ᵀ against the norm, the base matmul and add_lora_ref.
Under the Triton interpreter without a GPU (tests/conftest.py), compiled with one."""
from __future__ import annotations

import pytest
import torch

from loramux_kernels.lora import norm_shrink_cols
from loramux_kernels.lora.norm_shrink_cols import add_rms_norm_shrink_cols
from loramux_kernels.lora.reference import add_lora_ref, add_rms_norm_shrink_cols_ref
from tests.support.lora_pool import slot_pool
from tests.support.triton_mode import check_kernel_mode

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5
SLICES = {1: (0, 72), 2: (0, 40, 80), 3: (0, 96, 120, 144)}
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=6e-2, rtol=3e-2)}


def test_kernels_run_in_the_right_mode():
    check_kernel_mode(norm_shrink_cols)


def _slots(case: str, T: int, L: int, g: torch.Generator) -> torch.Tensor:
    one = int(torch.randint(0, L, (1,), generator=g))
    return {"one": torch.full((T,), one),
            "one_some_base": torch.where(torch.rand(T, generator=g) < 0.3, -1, one),
            "all_base": torch.full((T,), -1),
            "mixed": torch.randint(-1, L, (T,), generator=g)}[case].to(DEV, torch.int32)


def _inputs(T, N, S, R, ranks, case, dtype, has_add, seed):
    g = torch.Generator().manual_seed(seed)
    a, b, ranks_t = slot_pool(S, SLICES[S], ranks, N, dtype, DEV, R, seed)
    ts = _slots(case, T, len(ranks), g)
    x = (torch.randn(T, N, generator=g) * 2).to(DEV, dtype) if has_add else None
    res = (torch.randn(T, N, generator=g) * 3).to(DEV, dtype)
    w = (1 + torch.randn(N, generator=g) / 4).to(DEV, dtype)
    return a, b, ranks_t, ts, x, res, w


@pytest.mark.parametrize("T,N,S,R,ranks,case,dtype,has_add", [
    (1, 48, 3, 16, [16, 5], "one", torch.float32, True),
    (7, 72, 1, 16, [4, 16, 9], "one_some_base", torch.float32, True),
    (19, 72, 2, 16, [8, 3], "one_some_base", torch.float32, False),
    (33, 100, 3, 8, [8, 2, 5], "mixed", torch.float32, True),
    (16, 64, 3, 16, [16, 7], "all_base", torch.float32, True),
    (20, 96, 3, 16, [16, 11], "one_some_base", torch.bfloat16, True),
])
def test_matches_reference(T, N, S, R, ranks, case, dtype, has_add):
    """Normed columns, s columns (zero on base rows and past a slot's rank) and the new
    residual equal the reference; the old residual is not changed."""
    a, _, ranks_t, ts, x, res, w = _inputs(T, N, S, R, ranks, case, dtype, has_add, seed=T)
    before = res.clone()
    out, new_res = add_rms_norm_shrink_cols(x, res, w, EPS, a, ts, ranks_t)
    want, want_res = add_rms_norm_shrink_cols_ref(x, res, w, EPS, a, ts)
    assert out.shape == (T, N + S * R)
    torch.testing.assert_close(out[:, :N], want[:, :N], **TOL[dtype])
    torch.testing.assert_close(out[:, N:], want[:, N:], **TOL[dtype])
    torch.testing.assert_close(new_res, want_res, **TOL[dtype])
    assert torch.equal(res, before)
    base = ts < 0
    assert not out[base, N:].any(), "rows without an adapter get zero columns"
    s = out[:, N:].view(T, S, R)
    for slot, r in enumerate(ranks):      # columns past the slot's rank stay zero
        assert not s[ts == slot, :, r:].any()
    if (~base).any():
        assert want[~base, N:].abs().max() > 0.1, "the shrink is live"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_over_the_columns_adds_the_lora_delta(dtype):
    """[norm | s] @ [W | B_blockdiag]ᵀ = norm @ Wᵀ + the LoRA delta of the step's one
    adapter (add_lora_ref), nothing added to base rows."""
    T, N, S, R = 11, 72, 3, 16
    offsets = SLICES[S]
    a, b, ranks_t, ts, x, res, w = _inputs(T, N, S, R, [6, 16], "one_some_base", dtype,
                                           True, seed=3)
    slot = int(ts[ts >= 0][0])
    g = torch.Generator().manual_seed(4)
    W = (torch.randn(offsets[-1], N, generator=g) / N ** 0.5).to(DEV, dtype)
    wide = torch.zeros(offsets[-1], N + S * R, dtype=dtype, device=DEV)
    wide[:, :N] = W
    for i in range(S):
        lo, hi = offsets[i], offsets[i + 1]
        wide[lo:hi, N + i * R:N + (i + 1) * R] = b[slot, lo:hi]
    out, _ = add_rms_norm_shrink_cols(x, res, w, EPS, a, ts, ranks_t)
    got = out @ wide.T
    normed = out[:, :N]
    want = add_lora_ref(normed @ W.T, normed, a, b, ts, offsets)
    torch.testing.assert_close(got, want, **TOL[dtype])
    base = ts < 0
    torch.testing.assert_close(got[base], (normed @ W.T)[base], **TOL[dtype])


@pytest.mark.parametrize("T,N,S,R,ranks,case,dtype", [
    (1, 48, 3, 16, [16, 5], "one", torch.float32),
    (19, 72, 2, 16, [4, 16, 9], "one_some_base", torch.float32),
    (33, 300, 1, 8, [8, 2, 5], "mixed", torch.float32),
    (20, 96, 3, 16, [16, 11], "one_some_base", torch.bfloat16),
])
def test_delta_of_the_group_before_is_added_first(T, N, S, R, ranks, case, dtype):
    """With a delta (the expand of o or down folded into the norm after it): x + d·Bdᵀ
    per row's slot, rounded as the expand rounds it, then the same norm, shrink and
    residual as without; rows without an adapter get no delta; a width over the row
    programs' chunk (300 > 256) takes two chunks."""
    a, _, ranks_t, ts, x, res, w = _inputs(T, N, S, R, ranks, case, dtype, True, seed=T + 1)
    _, bd, _ = slot_pool(1, (0, N), ranks, 8, dtype, DEV, R, seed=T + 2)
    g = torch.Generator().manual_seed(T + 3)
    d = torch.randn(T, R + 5, generator=g).to(DEV, dtype)[:, :R]     # a strided view
    for slot, r in enumerate(ranks):       # as a GEMM against zero-padded A leaves it
        d[ts == slot, r:] = 0
    out, new_res = add_rms_norm_shrink_cols(x, res, w, EPS, a, ts, ranks_t,
                                            delta=(d, bd, ranks_t))
    want, want_res = add_rms_norm_shrink_cols_ref(x, res, w, EPS, a, ts, delta=(d, bd, None))
    plain, plain_res = add_rms_norm_shrink_cols_ref(x, res, w, EPS, a, ts)
    torch.testing.assert_close(out, want, **TOL[dtype])
    torch.testing.assert_close(new_res, want_res, **TOL[dtype])
    base = ts < 0
    _, alone_res = add_rms_norm_shrink_cols(x, res, w, EPS, a, ts, ranks_t)
    torch.testing.assert_close(new_res[base], alone_res[base], atol=0, rtol=0)
    if (~base).any():
        assert (want_res[~base] - plain_res[~base]).abs().max() > 0.1, "the delta is live"
