"""Host -> slot copies on a real GPU (skipped without one): a copy queued while a long
kernel still reads the slot (noted with note_reads) does not change what that kernel
reads, a read ordered after the copy's event sees the whole new adapter, and a copy into
another slot does not wait for that kernel; host buffers are page-locked and
reused only once the copies reading them completed; shared-memory ones are page-locked too."""
import gc

import pytest
import torch

from loramux_engine.adapters.copier import StreamCopier
from loramux_engine.lora import LoRASlotPool, load_lora
from loramux_engine.lora.host_buffers import HostBufferPool, shared_memory_pins
from loramux_core.model.hf_config import ModelConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def setup_pool(family):
    cfg = ModelConfig.from_dir(family.model_dir)
    pool = LoRASlotPool(cfg, 2, 32, torch.float32, "cuda")
    buffers = HostBufferPool(pin=True)
    w = {n: load_lora(family.adapters[n], cfg, 32, buffers=buffers) for n in ("rs4", "attn32")}
    return cfg, pool, buffers, w


def slow_read(t: torch.Tensor, reps: int = 2000) -> torch.Tensor:
    """Reads `t` many times on the current stream (long enough to overlap a copy)."""
    acc = torch.zeros((), device=t.device, dtype=torch.float64)
    for _ in range(reps):
        acc += t.double().sum()
    return acc / reps


def test_copy_waits_for_readers_and_step_waits_for_copy(llama_family):
    _, pool, _, w = setup_pool(llama_family)
    copier = StreamCopier(torch.device("cuda"))
    pool.load(0, w["rs4"])
    torch.cuda.synchronize()
    a_old = pool.weights(0, "qkv")[0][0].clone()
    torch.cuda._sleep(50_000_000)                              # the reads below wait
    read_old = slow_read(pool.weights(0, "qkv")[0][0])       # queued, still running
    copier.note_reads([0])
    handle = copier.queue(0, 2, lambda: pool.load(0, w["attn32"]))
    copier.order_compute_after(handle)
    a_new = pool.weights(0, "qkv")[0][0].clone()              # ordered after the copy
    torch.cuda.synchronize()
    assert torch.allclose(read_old, a_old.double().sum(), rtol=1e-9)
    want = torch.zeros_like(a_new)
    g = w["attn32"].groups[(0, "qkv")]
    want[:, :g.a.shape[1]] = g.a.cuda()
    assert torch.equal(a_new, want)


def test_copy_into_another_slot_overlaps_a_step_in_flight(llama_family):
    """A copy into slot 1 does not wait for queued work that reads only slot 0: it lands
    while that work still runs (the host waits for the copy alone)."""
    _, pool, buffers, w = setup_pool(llama_family)
    buffers.wait_registered()
    copier = StreamCopier(torch.device("cuda"))
    pool.load(0, w["rs4"])
    torch.cuda.synchronize()
    # a long step reading slot 0: ~1 s of GPU clock, so the host's queueing and wait below
    # fit inside it even on a loaded host (0.3 s before)
    torch.cuda._sleep(2_000_000_000)
    slow_read(pool.weights(0, "qkv")[0][0], reps=10)
    copier.note_reads([0])
    step_done = torch.cuda.Event()
    step_done.record()
    handle = copier.queue(1, 2, lambda: pool.load(1, w["attn32"]))
    copier.wait(handle)
    assert not step_done.query(), "the copy waited for a step that does not read its slot"
    torch.cuda.synchronize()


def test_host_buffers_are_pinned_and_reused_after_the_copy(llama_family):
    cfg, pool, buffers, w = setup_pool(llama_family)
    buffers.wait_registered()          # page-locked in the background after the load
    assert w["rs4"].pinned and w["rs4"].buffer.pinned
    copier = StreamCopier(torch.device("cuda"))
    first = w.pop("rs4")
    ptr = first.buffer.data.data_ptr()
    handle = copier.queue(1, 1, lambda: pool.load(1, first))
    del first
    gc.collect()                      # dropped while its copy may still run
    copier.wait(handle)
    again = load_lora(llama_family.adapters["rs4"], cfg, 32, buffers=buffers)
    assert again.buffer.data.data_ptr() == ptr and buffers.num_reuses == 1


def test_shared_host_buffers_are_pinned():
    """Loader processes write into shared-memory buffers; the driver must page-lock them
    (else slot loads copy synchronously and the engine falls back to in-process reads)."""
    assert shared_memory_pins()
    buffers = HostBufferPool(pin=True, shared=True)
    buf = buffers.acquire(84 << 20)
    buffers.wait_registered()
    assert buf.shared is not None and buf.pinned
    buf.data.fill_(7)
    dev = buf.data.to("cuda", non_blocking=True)
    assert int(dev[-1]) == 7
