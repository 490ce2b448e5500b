"""The mixture-of-experts kernels (kernels/moe_triton.py, in Triton's interpreter on the
CPU) against the torch reference (kernels/moe_ref.py) on random inputs: the pair layout,
the grouped GEMM alone, and the whole routed MLP with expert LoRA over a mixed batch
(base tokens, several slots, ranks padded with zeros)."""
import pytest
import torch

from loramux_kernels import moe, moe_ref
from tests.support.triton_mode import check_kernel_mode

moe_triton = pytest.importorskip("loramux_kernels.moe_triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_kernels_run_as_this_machine_needs():
    check_kernel_mode(moe_triton)


def _routed(T, E, k, H, gen):
    logits = torch.randn(T, E, generator=gen)
    return moe_ref.route_ref(logits, k, norm_topk_prob=False)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("P,G", [(1, 4), (7, 3), (40, 8), (33, 1), (3, 60), (9, 240),
                                 (300, 5)])
def test_align_covers_every_pair_once(P, G, use_kernel):
    gen = torch.Generator().manual_seed(P)
    group = torch.randint(-1, G, (P,), generator=gen)
    al = moe_triton.align(group.to(DEV), G, block_m=4, use_kernel=use_kernel)
    al = al._replace(sorted_ids=al.sorted_ids.cpu(), block_group=al.block_group.cpu())
    # row blocks launched: ceil(P / 4) plus one per group that can hold pairs, not per group
    assert al.block_group.numel() == -(-P // 4) + min(G, P)
    ids = al.sorted_ids.view(-1, 4)
    for block, g in zip(ids, al.block_group.tolist()):
        real = block[block < P]
        if g < 0:
            assert real.numel() == 0
        assert (group[real.long()] == g).all()
    kept = al.sorted_ids[al.sorted_ids < P].sort().values
    assert kept.tolist() == (group >= 0).nonzero().flatten().tolist()


@pytest.mark.parametrize("P,G,block_m", [(5, 60, 16), (257, 9, 16), (600, 300, 16),
                                         (1000, 7, 64)])
def test_align_kernel_matches_the_torch_layout(P, G, block_m):
    """The one-launch layout (align_kernel) is the torch ops' layout exactly, over several
    chunks of pairs and of groups (pairs in order within a group)."""
    gen = torch.Generator().manual_seed(P + G)
    group = torch.randint(-1, G, (P,), generator=gen).to(DEV)
    got = moe_triton.align(group, G, block_m, use_kernel=True)
    want = moe_triton.align(group, G, block_m, use_kernel=False)
    assert torch.equal(got.sorted_ids, want.sorted_ids)
    assert torch.equal(got.block_group, want.block_group)


@pytest.mark.parametrize("T,k,E,S", [(1, 4, 60, 4), (37, 2, 8, 3), (300, 4, 16, 5)])
def test_align_lora_kernel_matches_the_torch_layout(T, k, E, S):
    """Expert-LoRA groups (slot x expert, base tokens dropped) computed inside the
    one-launch layout: the torch ops' layout of pair_groups exactly."""
    gen = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(DEV)
    slots = torch.randint(-1, S, (T,), generator=gen).to(DEV)
    got = moe_triton.align_lora(ids, slots, E, S, use_kernel=True)
    want = moe_triton.align(moe_ref.pair_groups(ids, slots, E), S * E, use_kernel=False)
    assert got.block_m == want.block_m
    assert torch.equal(got.sorted_ids, want.sorted_ids)
    assert torch.equal(got.block_group, want.block_group)


@pytest.mark.parametrize("T,E,k,H,I", [(1, 4, 2, 32, 16), (19, 8, 2, 64, 48), (37, 6, 3, 40, 24),
                                         (150, 3, 2, 32, 16)])   # 100 pairs a group: 64-row blocks
def test_grouped_gemm_matches_reference(T, E, k, H, I):
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=gen)
    w = torch.randn(E, 2 * I, H, generator=gen)
    _, ids = _routed(T, E, k, H, gen)
    group = ids.reshape(-1)
    want = moe_ref.grouped_gemm_ref(x, w, group, k, torch.zeros(T * k, 2 * I))
    x, w, group = x.to(DEV), w.to(DEV), group.to(DEV)
    got = moe_triton.grouped_gemm(x, w, moe_triton.align(group, E), k,
                                  torch.zeros(T * k, 2 * I, device=DEV))
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    assert want.abs().max() > 1  # not a comparison of zeros


def _lora_pool(L, E, R, H, I, ranks, gen):
    """Pool tensors of L slots, each slot's rank columns past its rank zero."""
    a13, b13 = torch.randn(L, E, R, H, generator=gen), torch.randn(L, E, 2 * I, R, generator=gen)
    a2, b2 = torch.randn(L, E, R, I, generator=gen), torch.randn(L, E, H, R, generator=gen)
    for s, r in enumerate(ranks):
        for a in (a13, a2):
            a[s, :, r:] = 0
        for b in (b13, b2):
            b[s, :, :, r:] = 0
    return [t * 0.1 for t in (a13, b13, a2, b2)]


@pytest.mark.parametrize("T,E,k", [(1, 4, 2), (23, 8, 2), (16, 5, 3)])
def test_fused_moe_with_expert_lora_matches_reference(T, E, k):
    H, I, L, R = 48, 32, 3, 16
    gen = torch.Generator().manual_seed(100 + T)
    x = torch.randn(T, H, generator=gen)
    w13 = torch.randn(E, 2 * I, H, generator=gen) * 0.2
    w2 = torch.randn(E, H, I, generator=gen) * 0.2
    weights, ids = _routed(T, E, k, H, gen)
    slots = torch.randint(-1, L, (T,), generator=gen)
    a13, b13, a2, b2 = _lora_pool(L, E, R, H, I, [16, 4, 8], gen)
    for lora in (None, moe.ExpertLoRA(slots, a13, b13, a2, b2),
                 moe.ExpertLoRA(slots, None, None, a2, b2)):
        want = moe._run(None, x, w13, w2, weights, ids, lora)
        on_dev = [t.to(DEV) for t in (x, w13, w2, weights, ids)]
        lora_dev = None if lora is None else moe.ExpertLoRA(
            *[None if t is None else t.to(DEV) for t in lora])
        got = moe._run(moe_triton, *on_dev, lora_dev)
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    base = moe._run(None, x, w13, w2, weights, ids, None)
    with_lora = moe._run(None, x, w13, w2, weights, ids, moe.ExpertLoRA(slots, a13, b13, a2, b2))
    changed = (with_lora - base).abs().amax(dim=1) > 1e-3
    assert changed.tolist() == (slots >= 0).tolist()  # LoRA on adapter tokens only


def test_reference_matches_a_loop_over_tokens():
    """The reference's grouped form equals the plain per-token, per-expert computation."""
    T, E, k, H, I = 9, 4, 2, 16, 8
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=gen)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    weights, ids = moe_ref.route_ref(torch.randn(T, E, generator=gen), k, norm_topk_prob=True)
    torch.testing.assert_close(weights.sum(1), torch.ones(T))
    got = moe.fused_moe(x, w13, w2, weights, ids)
    for t in range(T):
        want = torch.zeros(H)
        for j in range(k):
            gate, up = (w13[ids[t, j]] @ x[t]).chunk(2)
            want += weights[t, j] * (w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(got[t], want, atol=1e-5, rtol=1e-5)
