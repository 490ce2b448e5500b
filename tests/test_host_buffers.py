"""Adapter host copies: one-pass conversion into reused host buffers, equal to the plain
conversion, buffers reused only once nothing reads them."""
from __future__ import annotations

import ctypes
import gc
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from loramux_engine.lora import load_lora
from loramux_engine.lora.host_buffers import HostBufferPool, populate
from loramux_core.model.hf_config import ModelConfig
from loramux_engine.parallel import TPGroup
from loramux_core.errors import AdapterError
from tests.support.tiny import AdapterSpec, make_adapter, make_model

WEIGHTS = "adapter_model.safetensors"
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("host_buffers")
    model_dir = make_model(root / "model")
    a = make_adapter(root / "a", model_dir, AdapterSpec(r=8, seed=1))
    b = make_adapter(root / "b", model_dir, AdapterSpec(r=8, seed=2))
    mixed = make_adapter(root / "mixed", model_dir, AdapterSpec(
        r=4, rank_pattern={"k_proj": 8}, target_modules=("q_proj", "k_proj", "down_proj"),
        seed=3))
    return ModelConfig.from_dir(model_dir), {"a": a, "b": b, "mixed": mixed}


def same(w1, w2) -> bool:
    return w1.groups.keys() == w2.groups.keys() and all(
        torch.equal(w1.groups[k].a, w2.groups[k].a) and torch.equal(w1.groups[k].b, w2.groups[k].b)
        and w1.groups[k].slice_ranks == w2.groups[k].slice_ranks for k in w1.groups)


def reference(path, cfg, tp=TPGroup.single(), dtype=torch.float32):
    """The host layout computed the plain way, from the whole file, in float32 math."""
    from loramux_core.adapter.plan import plan_adapter
    from loramux_core.model.lora_targets import lora_group_shapes, lora_shard, target

    plan = plan_adapter(path, cfg, 16)
    tensors = load_file(path / WEIGHTS)
    shapes = lora_group_shapes(cfg, tp.size)
    out = {}
    for mp in plan.modules:
        t = target(cfg, mp.module)
        out.setdefault((mp.layer, t.group), {})[t.slice] = mp
    ref = {}
    for (layer, group), slices in out.items():
        shape = shapes[group]
        r = max(m.rank for m in slices.values())
        a = torch.zeros(len(shape.out_features), r, shape.in_features)
        b = torch.zeros(sum(shape.out_features), r)
        off = 0
        for s, width in enumerate(shape.out_features):
            if s in slices:
                m = slices[s]
                cut = lora_shard(cfg, m.module, tp.rank, tp.size)
                ta, tb = tensors[m.a_key].float(), tensors[m.b_key].float()
                if cut.factor == "B":
                    tb = tb[cut.shard.start:cut.shard.stop]
                else:
                    ta = ta[:, cut.shard.start:cut.shard.stop]
                a[s, :m.rank] = ta
                b[off:off + width, :m.rank] = tb * m.scaling
            off += width
        ref[(layer, group)] = (a.to(dtype), b.to(dtype))
    return ref


@pytest.mark.parametrize("name", ["a", "mixed"])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_host_copy_matches_plain_conversion(base, name, tp_size):
    cfg, dirs = base
    for rank in range(tp_size):
        tp = TPGroup(rank, tp_size)
        w = load_lora(dirs[name], cfg, 16, tp=tp, buffers=HostBufferPool())
        ref = reference(dirs[name], cfg, tp)
        assert w.groups.keys() == ref.keys()
        for key, (a, b) in ref.items():
            assert torch.equal(w.groups[key].a, a), key
            assert torch.equal(w.groups[key].b, b), key


def test_bfloat16_rounds_once_like_float32_math(base):
    cfg, dirs = base
    w = load_lora(dirs["mixed"], cfg, 16, dtype=torch.bfloat16, buffers=HostBufferPool())
    for key, (a, b) in reference(dirs["mixed"], cfg, dtype=torch.bfloat16).items():
        assert torch.equal(w.groups[key].a, a) and torch.equal(w.groups[key].b, b), key


def test_buffer_reused_after_the_copy_is_dropped(base):
    cfg, dirs = base
    pool = HostBufferPool()
    w = load_lora(dirs["a"], cfg, 16, buffers=pool)
    ptr = w.buffer.data.data_ptr()
    first = w.groups[(0, "qkv")].a.clone()
    del w
    gc.collect()
    assert pool.num_free == 1
    w2 = load_lora(dirs["b"], cfg, 16, buffers=pool)
    assert w2.buffer.data.data_ptr() == ptr and pool.num_reuses == 1
    assert pool.num_allocations == 1
    assert same(w2, load_lora(dirs["b"], cfg, 16))       # nothing of "a" is left
    assert not torch.equal(w2.groups[(0, "qkv")].a, first)
    held = load_lora(dirs["a"], cfg, 16, buffers=pool)    # w2 still alive: a new buffer
    assert held.buffer.data.data_ptr() != ptr and pool.num_allocations == 2


class FakeEvent:
    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


def test_buffer_not_reused_while_a_device_copy_reads_it(base):
    cfg, dirs = base
    pool = HostBufferPool()
    w = load_lora(dirs["a"], cfg, 16, buffers=pool)
    ptr, event = w.buffer.data.data_ptr(), FakeEvent()
    w.buffer.fence(event)       # what LoRASlotPool.load does for a copy it queues on CUDA
    del w
    gc.collect()
    assert pool.num_free == 0
    w2 = load_lora(dirs["b"], cfg, 16, buffers=pool)
    assert w2.buffer.data.data_ptr() != ptr
    event.done = True
    w3 = load_lora(dirs["a"], cfg, 16, buffers=pool)
    assert w3.buffer.data.data_ptr() == ptr


def test_refused_adapter_gives_its_buffer_back(base, tmp_path):
    cfg, dirs = base
    import shutil
    d = shutil.copytree(dirs["a"], tmp_path / "bad")
    tensors = load_file(d / WEIGHTS)
    tensors[f"{Q0}.lora_B.weight"][3, 1] = float("nan")
    save_file(tensors, d / WEIGHTS)
    pool = HostBufferPool()
    with pytest.raises(AdapterError) as ei:
        load_lora(d, cfg, 16, buffers=pool)
    assert ei.value.feature == "non_finite" and f"{Q0}.lora_B.weight" in str(ei.value)
    assert pool.num_free == 1


def test_a_spare_buffer_is_made_ahead_for_the_next_adapter(base):
    """With spares=1, after a buffer of a size is handed out another of that size is made
    in the background, so the next adapter of that shape reuses instead of allocating;
    the spare is a distinct buffer and the adapter built in it is whole."""
    cfg, dirs = base
    pool = HostBufferPool(spares=1)
    w = load_lora(dirs["a"], cfg, 16, buffers=pool)
    pool.wait_spares()
    assert pool.num_free == 1 and pool.num_spares_made == 1 and pool.num_allocations == 1
    w2 = load_lora(dirs["b"], cfg, 16, buffers=pool)        # w still alive
    assert pool.num_reuses == 1 and pool.num_allocations == 1
    assert w2.buffer.data.data_ptr() != w.buffer.data.data_ptr()
    assert same(w2, load_lora(dirs["b"], cfg, 16)) and same(w, load_lora(dirs["a"], cfg, 16))
    pool.wait_spares()
    assert pool.num_free == 1 and pool.num_spares_made == 2  # the next one is ready too
    assert pool.allocated_bytes == 3 * pool.size_class(w.buffer.nbytes)


class SlowDriver:
    """Stands in for torch.cuda.cudart(): registration waits until `go` is set, as a
    driver serializing slow page-locking would."""

    def __init__(self):
        self.go = threading.Event()
        self.registered: list[int] = []

    def cudaHostRegister(self, ptr, size, flags):
        assert self.go.wait(30)
        self.registered.append(ptr)
        return 0

    def cudaHostUnregister(self, ptr):
        return 0


def test_loads_do_not_wait_for_page_locking(base, monkeypatch):
    """A pinning pool hands out buffers at once and registers them afterwards, off the
    caller's thread: adapters load (whole) while registration is held up, and their
    buffers become pinned once it proceeds."""
    driver = SlowDriver()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: driver)
    cfg, dirs = base
    pool = HostBufferPool(pin=True)
    loaded = [load_lora(dirs[n], cfg, 16, buffers=pool) for n in ("a", "b")]
    assert not any(w.pinned for w in loaded) and driver.registered == []
    assert same(loaded[1], load_lora(dirs["b"], cfg, 16))
    driver.go.set()
    pool.wait_registered()
    assert all(w.pinned for w in loaded)
    assert sorted(driver.registered) == sorted(w.buffer.data.data_ptr() for w in loaded)


def _resident_pages(data: torch.Tensor, nbytes: int) -> int:
    """Pages of `data[:nbytes]` in memory now (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = -(-nbytes // 4096)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(data.data_ptr(), nbytes, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw)


@pytest.mark.skipif(sys.platform != "linux", reason="madvise(MADV_POPULATE_WRITE), mincore: Linux")
@pytest.mark.parametrize("shared", [False, True])
def test_registering_faults_the_pages_in_first_and_keeps_the_bytes(shared):
    """cudaHostRegister faults missing pages in under the driver's lock, which every launch
    of the process waits for: register() populates them first (without CUDA, where the
    registration itself fails, the pages are still populated). Bytes a reader already
    wrote stay."""
    if not populate(torch.empty(4096, dtype=torch.uint8), 4096):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
    pool = HostBufferPool(pin=False, shared=shared)
    nbytes = 64 << 20
    buf = pool.acquire(nbytes)
    pages = nbytes // 4096
    assert _resident_pages(buf.data, nbytes) < pages // 2   # fresh: not there yet
    marks = torch.randint(1, 255, (64,), dtype=torch.uint8)
    at = torch.arange(64) * (nbytes // 64) + 17
    buf.data[at] = marks                                     # a reader's first bytes
    buf.register()
    assert _resident_pages(buf.data, nbytes) == pages
    assert torch.equal(buf.data[at], marks)
