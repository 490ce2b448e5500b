"""Triton paged attention and KV store against the torch reference (kernels/attention_ref.py).

Without CUDA the kernels run under the Triton interpreter: tests/conftest.py sets
TRITON_INTERPRET before any kernel module is imported, and
`test_kernels_run_as_this_machine_needs` fails if that did not take effect.
"""
from __future__ import annotations

import pytest
import torch

from loramux_kernels import attention_kernels_triton
from loramux_kernels.attention_ref import paged_attention_ref, store_kv_ref
from loramux_kernels.attention_triton import paged_attention, store_kv
from loramux_kernels.attention_metadata import AttentionMetadata
from tests.support.triton_mode import check_kernel_mode

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
BS = 16
D = 32
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _batch(ctx_lens, q_lens, H, KVH, dtype, seed=0):
    """Sequences with `ctx_lens` cached tokens and `q_lens` new ones (K/V already stored),
    blocks drawn from a shuffled pool so block tables are non-contiguous."""
    g = torch.Generator().manual_seed(seed)
    seq = [c + n for c, n in zip(ctx_lens, q_lens)]
    nblk = [-(-s // BS) for s in seq]
    total = sum(nblk) + 3
    perm = torch.randperm(total, generator=g)
    bt = torch.zeros(len(seq), max(nblk), dtype=torch.int32)
    used = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[used:used + n]
        used += n
    kc = torch.randn(total, BS, KVH, D, generator=g).to(dtype)
    vc = torch.randn(total, BS, KVH, D, generator=g).to(dtype)
    pos = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx_lens, q_lens)])
    seq_of = torch.repeat_interleave(torch.arange(len(seq)), torch.tensor(q_lens))
    attn = AttentionMetadata(
        positions=pos.to(DEV), slot_mapping=(bt[seq_of, pos // BS].long() * BS + pos % BS).to(DEV),
        query_start_loc=torch.tensor([0] + list(q_lens)).cumsum(0).to(DEV, torch.int32),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=DEV), block_tables=bt.to(DEV),
        max_query_len=max(q_lens), max_seq_len=max(seq), block_size=BS)
    q = torch.randn(len(pos), H, D, generator=g).to(DEV, dtype)
    return q, kc.to(DEV), vc.to(DEV), attn


def _check(ctx_lens, q_lens, H, KVH, dtype=torch.float32, num_splits=None, seed=0,
           window=None):
    q, kc, vc, attn = _batch(ctx_lens, q_lens, H, KVH, dtype, seed)
    want = paged_attention_ref(q, kc, vc, attn.positions, attn.query_start_loc, attn.seq_lens,
                               attn.block_tables, D ** -0.5, window)
    out = torch.full_like(q, float("nan"))           # poison: every element must be written
    got = paged_attention(q, kc, vc, attn, D ** -0.5, num_splits=num_splits, out=out,
                          window=window)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,KVH", [(4, 4), (4, 2), (8, 2)])
def test_pure_decode(dtype, H, KVH):
    _check([5, 40, 16, 1], [1, 1, 1, 1], H, KVH, dtype)


@pytest.mark.parametrize("H,KVH", [(4, 4), (8, 2)])
def test_pure_prefill(H, KVH):
    _check([0, 0], [37, 5], H, KVH)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,KVH", [(2, 1), (8, 2)])
def test_mixed_batch_with_cached_prefixes(dtype, H, KVH):
    """Decodes, a fresh prefill and chunked-prefill continuations over cached prefixes."""
    _check([30, 0, 16, 7, 50], [1, 20, 9, 1, 70], H, KVH, dtype, seed=3)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_kv_decode_over_long_contexts(num_splits):
    _check([200, 3, 130], [1, 1, 1], 8, 2, num_splits=num_splits, seed=4)


def test_split_kv_in_a_mixed_batch():
    """Splits apply to every tile, including tiles of a prefill chunk and empty splits."""
    _check([150, 0], [1, 24], 4, 2, num_splits=3, seed=5)


def test_automatic_split_choice():
    _check([300], [1], 4, 1, seed=6)


# Sliding window: contexts of several cache blocks (BS = 16) against windows shorter than
# them, on block boundaries and off them, down to a window of one token.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 16, 21])
def test_sliding_window_decode(dtype, window):
    _check([5, 40, 100, 16, 63], [1] * 5, 8, 2, dtype, window=window, seed=11)


@pytest.mark.parametrize("window", [7, 33])
def test_sliding_window_prefill_and_chunks(window):
    """Fresh prefills, chunked-prefill continuations over cached prefixes and decodes in one
    batch: tiles whose tokens' windows start in different blocks."""
    _check([30, 0, 16, 7, 50, 0], [1, 20, 9, 1, 70, 3], 4, 2, window=window, seed=12)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_sliding_window_split_kv(num_splits):
    """Splits cover the window's key range (some of them empty for the shorter contexts)."""
    _check([200, 3, 130, 0], [1, 1, 1, 24], 8, 2, num_splits=num_splits, window=70, seed=13)


def test_sliding_window_automatic_splits():
    """Splits chosen from the window, not the context: a window of 600 over 900 keys."""
    _check([900, 650], [1, 1], 4, 1, window=600, seed=14)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_sliding_window_reads_no_block_before_it(num_splits):
    """Decodes read no cache block that lies wholly before their window: NaN there (which
    a masked read would still carry into the output: 0 * NaN) changes nothing."""
    window = 20
    q, kc, vc, attn = _batch([100, 57, 140], [1, 1, 1], 4, 2, torch.float32, seed=15)
    want = paged_attention_ref(q, kc, vc, attn.positions, attn.query_start_loc, attn.seq_lens,
                               attn.block_tables, D ** -0.5, window)
    for b, p in enumerate(attn.positions.tolist()):
        first = (p - window + 1) // BS            # the block the window starts in
        assert first >= 2
        kc[attn.block_tables[b, :first].long()] = float("nan")
        vc[attn.block_tables[b, :first].long()] = float("nan")
    got = paged_attention(q, kc, vc, attn, D ** -0.5, num_splits=num_splits, window=window)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_window_longer_than_every_context_is_plain_causal():
    q, kc, vc, attn = _batch([30, 0], [1, 20], 4, 2, torch.float32, seed=16)
    plain = paged_attention(q, kc, vc, attn, D ** -0.5)
    torch.testing.assert_close(paged_attention(q, kc, vc, attn, D ** -0.5, window=64), plain,
                               **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_only_mapped_slots(dtype):
    g = torch.Generator().manual_seed(1)
    T, KVH, nb = 6, 2, 4
    qkv = torch.randn(T, (4 + 2 * KVH) * D, generator=g).to(DEV, dtype)  # k/v: views into it
    k = qkv[:, 4 * D:(4 + KVH) * D].view(T, KVH, D)
    v = qkv[:, (4 + KVH) * D:].view(T, KVH, D)
    slots = torch.tensor([17, 3, -1, 40, 63, 0], device=DEV)
    kc = torch.randn(nb, BS, KVH, D, generator=g).to(DEV, dtype)   # poison: random cache
    vc = torch.randn(nb, BS, KVH, D, generator=g).to(DEV, dtype)
    want_k, want_v = kc.clone(), vc.clone()
    store_kv_ref(k, v, want_k, want_v, slots)
    store_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_bad_shapes_raise_precise_errors():
    q, kc, vc, attn = _batch([4], [2], 4, 2, torch.float32)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(q[..., :16], kc, vc, attn, 1.0)
    with pytest.raises(ValueError, match="attn describes"):
        paged_attention(q[:1], kc, vc, attn, 1.0)
    with pytest.raises(ValueError, match="window=0 must be a positive int"):
        paged_attention(q, kc, vc, attn, 1.0, window=0)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(q[:, :2], q[:, :2], kc, vc, attn.slot_mapping[:1])


@pytest.mark.parametrize("module", [attention_kernels_triton], ids=lambda m: m.__name__)
def test_kernels_run_as_this_machine_needs(module):
    """Interpreted on the CPU (so the other tests here run the Triton kernels, not only the
    references), compiled on CUDA."""
    check_kernel_mode(module)


def _naive_attention(q, kc, vc, attn, scale):
    """Token by token, head by head, straight from the definition."""
    out = torch.zeros_like(q, dtype=torch.float32)
    starts, lens = attn.query_start_loc.tolist(), attn.seq_lens.tolist()
    group = q.shape[1] // kc.shape[2]
    for b, L in enumerate(lens):
        slots = [int(attn.block_tables[b, p // BS]) * BS + p % BS for p in range(L)]
        k = kc.view(-1, *kc.shape[2:])[slots].float()
        v = vc.view(-1, *vc.shape[2:])[slots].float()
        for t in range(starts[b], starts[b + 1]):
            p = int(attn.positions[t])
            for h in range(q.shape[1]):
                w = torch.softmax(k[:p + 1, h // group] @ q[t, h].float() * scale, dim=0)
                out[t, h] = w @ v[:p + 1, h // group]
    return out.to(q.dtype)


@pytest.mark.parametrize("H,KVH", [(4, 4), (8, 2)])
def test_reference_matches_the_definition(H, KVH):
    """The reference (per-sequence SDPA) against attention computed from its definition,
    with NaN in the cache slots past each sequence's length."""
    q, kc, vc, attn = _batch([30, 0, 16, 7], [1, 20, 9, 1], H, KVH, torch.float32, seed=8)
    q, kc, vc = q.cpu(), kc.cpu(), vc.cpu()
    attn = AttentionMetadata(**{f: getattr(attn, f).cpu() if torch.is_tensor(getattr(attn, f))
                                else getattr(attn, f) for f in attn.__dataclass_fields__})
    used = set()
    for b, L in enumerate(attn.seq_lens.tolist()):
        used |= {int(attn.block_tables[b, p // BS]) * BS + p % BS for p in range(L)}
    unused = torch.tensor(sorted(set(range(kc.shape[0] * BS)) - used))
    kc.view(-1, KVH, D)[unused] = float("nan")
    vc.view(-1, KVH, D)[unused] = float("nan")
    want = _naive_attention(q, kc, vc, attn, D ** -0.5)
    got = paged_attention_ref(q, kc, vc, attn.positions, attn.query_start_loc, attn.seq_lens,
                              attn.block_tables, D ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
