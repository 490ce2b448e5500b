"""The slot-indexed per-token kernels (kernels/lora/slot_rows.py: DoRA's row factors,
embed_tokens LoRA) and add_lora on lm_head's shape (one vocabulary-wide slice, float32
logits, weights in the model dtype) against the torch references (kernels/lora/reference.py),
on random weights and mixed slots with base rows. Without CUDA the kernels run in
Triton's interpreter (tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from loramux_kernels import lora as lora_kernels
from loramux_kernels.lora import slot_rows
from loramux_kernels.lora.launch import add_lora, build_meta
from loramux_kernels.lora.plan import TOKEN_PATH_MAX_TOKENS
from loramux_kernels.lora.reference import add_embedding_lora_ref, add_lora_ref, scale_rows_ref
from loramux_kernels.lora.slot_rows import add_embedding_lora, scale_rows
from tests.support.triton_mode import check_kernel_mode

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}
L = 5  # slots; slot 4 stays unused


def _slots(T: int, seed: int) -> torch.Tensor:
    """Random slots in -1..L-2, every one of them (base rows too) once T >= L; one
    token: slot 0."""
    g = torch.Generator().manual_seed(seed)
    ts = torch.randint(-1, L - 1, (T,), generator=g)
    ts[:min(T, L)] = torch.tensor([0, -1, 1, 2, 3])[:min(T, L)]
    return ts[torch.randperm(T, generator=g)].to(torch.int32).to(DEV)


def test_kernels_run_as_this_machine_needs():
    check_kernel_mode(slot_rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,N", [(1, 40), (7, 72), (33, 1100)])
def test_scale_rows_matches_reference(dtype, T, N):
    g = torch.Generator().manual_seed(T + N)
    y = torch.randn(T, N, generator=g).to(DEV, dtype)
    scale = (1 + 0.3 * torch.randn(L + 1, N, generator=g)).to(DEV)  # float32, as the pool's
    scale[-1] = 1.0
    scale[2] = 1.0                      # a slot without DoRA
    ts = _slots(T, seed=T)
    want = scale_rows_ref(y.clone(), scale, ts)
    got = scale_rows(y.clone(), scale, ts)
    torch.testing.assert_close(got, want, **TOL[dtype])
    plain = (ts < 0) | (ts == 2)
    assert torch.equal(got[plain], y[plain]), "base rows and factor-1 slots must be untouched"
    if T > 1:
        assert not torch.equal(got, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 9, TOKEN_PATH_MAX_TOKENS + 13])
def test_embedding_lora_matches_reference(dtype, T):
    """Token path up to TOKEN_PATH_MAX_TOKENS tokens, the tile list's expand above."""
    g = torch.Generator().manual_seed(T)
    V, H, R = 97, 48, 16
    a = torch.randn(L, R, V, generator=g).to(DEV, dtype)
    b = (torch.randn(L, H, R, generator=g) / R ** 0.5).to(DEV, dtype)
    a[1, 8:] = 0                        # slot 1 has rank 8
    b[1, :, 8:] = 0
    ids = torch.randint(0, V, (T,), generator=g).to(DEV)
    ts = _slots(T, seed=T + 1)
    y = torch.randn(T, H, generator=g).to(DEV, dtype)
    want = add_embedding_lora_ref(y.clone(), ids, a, b, ts)
    got = add_embedding_lora(y.clone(), ids, a, b, ts)
    torch.testing.assert_close(got, want, **TOL[dtype])
    got_meta = add_embedding_lora(y.clone(), ids, a, b, ts, meta=build_meta(ts, L))
    torch.testing.assert_close(got_meta, want, **TOL[dtype])
    assert torch.equal(got[ts < 0], y[ts < 0]), "base rows must be untouched"
    assert (got - y)[ts >= 0].abs().max() > 0.1


def test_embedding_reference_is_the_gathered_product():
    """The reference itself against a per-token loop."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(L, 4, 11, generator=g), torch.randn(L, 6, 4, generator=g)
    ids, ts = torch.tensor([3, 0, 10, 3]), torch.tensor([2, -1, 0, 2])
    got = add_embedding_lora_ref(torch.zeros(4, 6), ids, a, b, ts)
    for t in range(4):
        want = b[ts[t]] @ a[ts[t], :, ids[t]] if ts[t] >= 0 else torch.zeros(6)
        torch.testing.assert_close(got[t], want)


@pytest.mark.parametrize("T", [3, 20])
def test_head_shaped_add_lora_matches_reference(T):
    """lm_head LoRA as add_lora sees it: a [L, 1, R, H] (a view of the pool's [L, R, H]),
    b [L, V, R] in bfloat16, y the float32 logits."""
    g = torch.Generator().manual_seed(T)
    V, H, R = 1000, 48, 8
    a = torch.randn(L, R, H, generator=g).to(DEV, torch.bfloat16)
    b = (torch.randn(L, V, R, generator=g) / R).to(DEV, torch.bfloat16)
    x = torch.randn(T, H, generator=g).to(DEV, torch.bfloat16)
    y = torch.randn(T, V, generator=g).to(DEV)
    ts = _slots(T, seed=T + 2)
    want = add_lora_ref(y.clone(), x, a[:, None], b, ts, (0, V))
    got = add_lora(y.clone(), x, a[:, None], b, ts, (0, V))
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert torch.equal(got[ts < 0], y[ts < 0])


def test_dispatch_takes_the_reference_off_cuda():
    """loramux_kernels.lora's choice (CPU tensors: the references) gives the same values."""
    ts = _slots(6, seed=9).cpu()
    y, scale = torch.randn(6, 8), torch.rand(L + 1, 8) + 0.5
    scale[-1] = 1
    torch.testing.assert_close(lora_kernels.scale_rows(y.clone(), scale, ts),
                               scale_rows_ref(y.clone(), scale, ts))
