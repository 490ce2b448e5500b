"""The greedy pick kernel (kernels/greedy_pick_triton.py) against the torch reference
(kernels/greedy_pick_ref.py, the Sampler's greedy ops): under the Triton interpreter
without CUDA, compiled on a GPU. Fresh random logits with equal maxima placed on purpose
(within one chunk and across chunks: the first index must win, as torch.argmax picks),
-inf entries, rows of one value and a row of only -inf; token ids equal exactly, logprobs
within 1e-5. Poisoned scratch (the wrapper allocates with empty). And the dispatch the
greedy CUDA graph goes through (engine/cuda_graph.py GREEDY_PICK)."""
from __future__ import annotations

import pytest
import torch

from loramux_kernels import greedy_pick as dispatch
from loramux_kernels import greedy_pick_kernels_triton
from loramux_kernels import greedy_pick_triton as T
from loramux_kernels.greedy_pick_ref import greedy_pick_ref
from tests.support.triton_mode import check_kernel_mode

# the rows of only -inf compute nan on purpose (as torch does): numpy warns in the
# interpreter
pytestmark = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning",
                                        "ignore:divide by zero:RuntimeWarning")
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch):
    """Every buffer the wrapper allocates with torch.empty* starts as NaN (-1: integers)."""
    real_empty, real_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan") if t.is_floating_point() else -1)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_like(*a, **k)))


def make_logits(B: int, V: int, chunk: int, dtype, seed: int) -> torch.Tensor:
    """Random logits; row 0: two equal maxima in different chunks; row 1: two within one
    chunk (the first index must win both times); row 2: a third of its entries -inf,
    its first chunk wholly, its max last; row 3: one value throughout; row 4: only -inf."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, V, generator=gen) * 4).to(dtype)
    top = float(x.float().max()) + 1
    ties = {0: (min(V - 1, chunk + 3), min(V - 1, 2 * chunk + 5)), 1: (V // 2 + 1, V // 2 + 2)}
    for row, cols in ties.items():
        if row < B:
            x[row, list(cols)] = top
    if B > 2:
        x[2, torch.rand(V, generator=gen) < 0.33] = float("-inf")
        x[2, :chunk] = float("-inf")   # a chunk of only -inf (when V > chunk)
        x[2, V - 1] = top   # its max in the last (partial) chunk
    if B > 3:
        x[3] = 1.5
    if B > 4:
        x[4] = float("-inf")
    return x.to(DEV)


def assert_picks(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == torch.float64
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0, equal_nan=True)


def test_kernels_run_as_this_machine_needs():
    check_kernel_mode(greedy_pick_kernels_triton)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,V,chunk", [(1, 100, T.CHUNK), (5, 9000, T.CHUNK),
                                       (7, 2 * T.CHUNK + 17, T.CHUNK), (6, 1100, 64),
                                       (3, 1024, 64)])
def test_pick_matches_the_reference(dtype, B, V, chunk):
    """V not a multiple of the chunk (masked tail, a combine over a padded block of
    chunks), fewer values than a chunk, and an exact number of chunks."""
    x = make_logits(B, V, chunk, dtype, seed=B * V + chunk)
    want = greedy_pick_ref(x)
    if B > 1:
        assert want[0, 0] == min(V - 1, chunk + 3) and want[0, 1] == V // 2 + 1
    assert_picks(T.greedy_pick(x, chunk=chunk), want)


def test_rows_strided_and_alone():
    """Rows of a wider tensor (row stride above V: the values past V are larger, so
    reading them would change the picks), and each row alone gives what it gives in the
    batch."""
    wide = make_logits(6, 3040, 256, torch.float32, seed=5)
    wide[:, 3000:] = 1e4
    x = wide[:, :3000]
    batch = T.greedy_pick(x, chunk=256)
    assert_picks(batch, greedy_pick_ref(x))
    for r in range(x.shape[0]):
        assert_picks(T.greedy_pick(x[r:r + 1], chunk=256), batch[:, r:r + 1])


@pytest.mark.skipif(not CUDA, reason="compiled variants: a GPU")
def test_one_compiled_variant_for_every_batch_size():
    """The grids and the compiled variants depend on the vocabulary only: a graph bucket
    of any size reuses the variant the first pick compiled (the start-up warm-up needs no
    per-bucket compile)."""
    kernels = (greedy_pick_kernels_triton.chunk_stats_kernel,
               greedy_pick_kernels_triton.combine_kernel)
    if not all(hasattr(k, "device_caches") for k in kernels):
        pytest.skip("this Triton keeps no device_caches")

    def variants():
        return [sum(len(c[0]) for c in k.device_caches.values()) for k in kernels]
    x = make_logits(64, 999, 32, torch.bfloat16, seed=9)
    T.greedy_pick(x[:2], chunk=32)
    first = variants()
    for B in (1, 3, 16, 17, 64):
        assert_picks(T.greedy_pick(x[:B], chunk=32), greedy_pick_ref(x[:B]))
    assert variants() == first


def test_dispatch_takes_the_kernel_only_when_asked_and_on_a_gpu(monkeypatch):
    """loramux_kernels.greedy_pick: the reference unless `kernel` and the logits are on CUDA
    with Triton (CUDA stood in for by patching the check: the kernel then runs in the
    interpreter here)."""
    calls = []
    real = T.greedy_pick
    monkeypatch.setattr(T, "greedy_pick", lambda x: calls.append(x.shape) or real(x))
    x = make_logits(4, 700, T.CHUNK, torch.float32, seed=2)
    assert_picks(dispatch.greedy_pick(x, kernel=True), greedy_pick_ref(x))
    assert len(calls) == (1 if CUDA else 0)
    monkeypatch.setattr(dispatch, "_gpu", lambda t: True)
    assert_picks(dispatch.greedy_pick(x), greedy_pick_ref(x))
    assert len(calls) == (1 if CUDA else 0)
    assert_picks(dispatch.greedy_pick(x, kernel=True), greedy_pick_ref(x))
    assert len(calls) == (2 if CUDA else 1)
