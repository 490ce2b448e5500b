"""Triton RMSNorm, SiLU-and-multiply and rotary kernels against the torch references
(kernels/elementwise_ref.py): under the Triton interpreter on a machine without CUDA
(float32; tests/conftest.py sets TRITON_INTERPRET before any kernel module is imported),
compiled on a GPU (float32 and bfloat16). Fresh random inputs, poisoned outputs (the
wrappers allocate with empty; the rotary output is its input, rewritten)."""
from __future__ import annotations

import pytest
import torch

from loramux_kernels import elementwise_kernels_triton
from loramux_kernels import elementwise_triton as T
from loramux_kernels.attention_ref import store_kv_ref
from loramux_kernels.elementwise_ref import (add_rms_norm_ref, rms_norm_ref, rotary_ref,
                                     silu_mul_ref)
from tests.support.triton_mode import check_kernel_mode

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch):
    """Every buffer the wrappers allocate with torch.empty* starts as NaN."""
    real_empty, real_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: real_like(*a, **k).fill_(float("nan")))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (5, 96), (3, 200)])
def test_rms_norm(dtype, rows, n):
    gen = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=gen) * 3).to(DEV, dtype)
    w = torch.randn(n, generator=gen).to(DEV, dtype)
    torch.testing.assert_close(T.rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 32), (4, 100), (2, 1536)])
def test_silu_mul(dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    x = (torch.randn(rows, 2 * inter, generator=gen) * 2).to(DEV, dtype)
    torch.testing.assert_close(T.silu_mul(x), silu_mul_ref(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h,kvh,d", [(1, 4, 2, 16), (6, 8, 2, 32), (3, 2, 2, 64)])
def test_rotary_in_place_views(dtype, t, h, kvh, d):
    """q and k are views into one merged qkv row (as in the model), rotated in place;
    v next to them is left alone."""
    gen = torch.Generator().manual_seed(t * h * d)
    pos_max = 50
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = torch.arange(pos_max).float()[:, None] * inv[None]
    emb = torch.cat((f, f), -1)
    cos, sin = emb.cos().to(DEV), emb.sin().to(DEV)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=gen).to(DEV, dtype)
    positions = torch.randint(0, pos_max, (t,), generator=gen).to(DEV)
    q = qkv[:, :h * d].reshape(t, h, d)
    k = qkv[:, h * d:(h + kvh) * d].reshape(t, kvh, d)
    want_q, want_k = rotary_ref(positions, q.clone(), k.clone(), cos, sin)
    v_before = qkv[:, (h + kvh) * d:].clone()
    got_q, got_k = T.rotary(positions, q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    assert torch.equal(qkv[:, (h + kvh) * d:], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (5, 96), (3, 200)])
def test_add_rms_norm(dtype, rows, n):
    """The residual add fused into RMSNorm: the new residual (written in place) and the
    normed output both match add-then-norm."""
    gen = torch.Generator().manual_seed(rows * n + 1)
    x = (torch.randn(rows, n, generator=gen) * 3).to(DEV, dtype)
    res = (torch.randn(rows, n, generator=gen) * 3).to(DEV, dtype)
    w = torch.randn(n, generator=gen).to(DEV, dtype)
    want_out, want_res = add_rms_norm_ref(x, res.clone(), w, 1e-5)
    got_out, got_res = T.add_rms_norm(x, res, w, 1e-5)
    assert got_res.data_ptr() == res.data_ptr()
    torch.testing.assert_close(got_res, want_res, **TOL[dtype])
    torch.testing.assert_close(got_out, want_out, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h,kvh,d,bs", [(1, 4, 2, 16, 4), (6, 8, 2, 32, 2), (3, 2, 2, 64, 8)])
def test_rotary_store_kv(dtype, t, h, kvh, d, bs):
    """Rotary on q/k views of one merged qkv row plus the paged KV store in one launch:
    the cache holds rotated k and plain v at each token's slot, slot -1 writes nothing,
    every other cache entry keeps its (random) contents."""
    gen = torch.Generator().manual_seed(t * h * d + bs)
    pos_max = 50
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = torch.arange(pos_max).float()[:, None] * inv[None]
    emb = torch.cat((f, f), -1)
    cos, sin = emb.cos().to(DEV), emb.sin().to(DEV)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=gen).to(DEV, dtype)
    positions = torch.randint(0, pos_max, (t,), generator=gen).to(DEV)
    q = qkv[:, :h * d].reshape(t, h, d)
    k = qkv[:, h * d:(h + kvh) * d].reshape(t, kvh, d)
    v = qkv[:, (h + kvh) * d:].reshape(t, kvh, d)
    blocks = t + 2
    k_cache = torch.randn(blocks, bs, kvh, d, generator=gen).to(DEV, dtype)
    v_cache = torch.randn(blocks, bs, kvh, d, generator=gen).to(DEV, dtype)
    slots = torch.randperm(blocks * bs, generator=gen)[:t]
    slots[0] = -1
    slots = slots.to(DEV)
    want_q, want_k = rotary_ref(positions, q.clone(), k.clone(), cos, sin)
    want_kc, want_vc = k_cache.clone(), v_cache.clone()
    store_kv_ref(want_k, v.clone(), want_kc, want_vc, slots)
    v_before = v.clone()
    got_q, got_k = T.rotary_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slots)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    torch.testing.assert_close(k_cache, want_kc, **TOL[dtype])
    assert torch.equal(v_cache, want_vc) and torch.equal(v, v_before)


@pytest.mark.parametrize("module", [elementwise_kernels_triton], ids=lambda m: m.__name__)
def test_kernels_run_as_this_machine_needs(module):
    """Interpreted on the CPU (so the other tests here run the Triton kernels, not only the
    references), compiled on CUDA."""
    check_kernel_mode(module)
