"""Nothing touches CUDA from a finalizer: a host copy's buffer found by the garbage
collector inside a CUDA-graph capture or inside a step's forward pass is only queued
there; its owner takes it back (querying the buffer's copy fences) at the next safe point.

The device is a stand-in on the CPU: a capture is a flag that torch.cuda's own question
(`is_current_stream_capturing`) answers, and a copy fence is an event whose `query`
records the thread it ran on and whether a capture or a forward pass was open then."""
from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from loramux_engine.lora.host_buffers import HostBufferPool
from loramux_engine.releases import ReleaseQueue


class Device:
    """What is open on the device right now, as the fences see it."""

    def __init__(self):
        self.capturing = False
        self.in_forward = False
        self.queries: list[tuple[str, bool, bool]] = []   # (thread, capturing, in forward)


class Fence:
    """A completed copy's event that records when it is asked."""

    def __init__(self, device: Device):
        self.device = device

    def query(self) -> bool:
        d = self.device
        d.queries.append((threading.current_thread().name, d.capturing, d.in_forward))
        return True


class Holder:
    """A host copy's owner in a reference cycle: only the collector frees it."""

    def __init__(self):
        self.me = self


def held_buffer(pool: HostBufferPool, device: Device) -> list[Holder]:
    """A buffer of `pool` attached to a cyclic owner and fenced by a copy; returns the
    list that holds the owner (clear it to drop the last reference)."""
    buf = pool.acquire(1 << 16)
    owner = Holder()
    pool.attach(owner, buf)
    buf.fence(Fence(device))
    return [owner]


def test_queue_waits_while_this_thread_captures(monkeypatch):
    device = Device()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: device.capturing)
    done, queue = [], ReleaseQueue()
    queue.put(done.append, 1)
    device.capturing = True
    assert queue.run() == 0 and done == [] and len(queue) == 1
    device.capturing = False
    assert queue.run() == 1 and done == [1] and len(queue) == 0
    queue.close()     # the owner is gone: no safe point will come, work runs at once
    queue.put(done.append, 2)
    assert done == [1, 2]
    device.capturing = True    # ... except inside a capture
    queue.put(done.append, 3)
    assert done == [1, 2] and len(queue) == 1


class _CollectingModel:
    """Drops the last reference to a host copy and runs the collector while the graph
    is being captured (what an allocation inside the capture can set off)."""

    def __init__(self, device: Device, holders: list):
        self.device, self.holders = device, holders

    def forward(self, ids, attn, kv_caches, lora):
        if self.device.capturing:
            self.holders.clear()
            gc.collect()
        return ids[:, None].float()


def test_a_collection_inside_a_graph_capture_queries_no_fence(monkeypatch):
    from loramux_engine.cuda_graph import CudaGraphRunner
    from tests.support import fake_cuda

    cuda, device = fake_cuda.install(monkeypatch), Device()

    class Capture:
        def __init__(self, *a, **k):
            self.stream = cuda.use(cuda.new_stream())

        def __enter__(self):
            device.capturing = True
            return self.stream.__enter__()

        def __exit__(self, *exc):
            device.capturing = False
            return self.stream.__exit__(*exc)

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: device.capturing)
    pool = HostBufferPool()
    holders = held_buffer(pool, device)
    runner = CudaGraphRunner(_CollectingModel(device, holders), None, None, 4, 8, 64,
                             torch.device("cpu"))
    runner.capture_all([(8, False, False, False, False, False, False, False)])
    assert not holders and runner.graph_keys   # the owner was collected in the capture
    assert device.queries == [] and len(pool.releases) == 1
    pool.collect()   # the owner's next safe point (Engine._step starts with it)
    assert device.queries == [(threading.current_thread().name, False, False)]
    assert pool.num_free == 1 and len(pool.releases) == 0


@pytest.mark.engine_device("cpu")
def test_a_collection_inside_a_step_is_taken_back_at_the_next_step(llama_family):
    from loramux_engine import Engine, EngineConfig, SamplingParams

    device = Device()
    eng = Engine(EngineConfig(model=str(llama_family.model_dir), max_loras=2,
                              num_kv_blocks=64, adapter_loaders=0))
    try:
        pool = eng.host_buffers
        holders = held_buffer(pool, device)
        pool.wait_spares()   # the engine's pool makes a spare of each size it hands out
        free_before = pool.num_free

        forward = eng.model.forward

        def collecting_forward(*args, **kwargs):
            device.in_forward = True
            holders.clear()
            gc.collect()
            try:
                return forward(*args, **kwargs)
            finally:
                device.in_forward = False

        eng.model.forward = collecting_forward   # what the step's runner calls
        eng.add_request("r", [5, 17, 40, 99], SamplingParams(temperature=0.0, max_tokens=3))
        eng.step()
        assert not holders and device.queries == [] and len(pool.releases) == 1
        eng.step()   # its start takes the buffer back, outside any forward pass
        assert device.queries[0] == (threading.current_thread().name, False, False)
        assert len(pool.releases) == 0 and pool.num_free == free_before + 1
    finally:
        eng.close()


class Driver:
    """cudaHostRegister/Unregister that record the calls and whether a capture was open."""

    def __init__(self, device: Device):
        self.device, self.unregistered = device, []

    def cudaHostRegister(self, ptr, nbytes, flags):
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append((ptr, self.device.capturing))
        return 0


def test_a_page_locked_buffer_collected_in_a_capture_is_unregistered_after(monkeypatch):
    device = Device()
    driver = Driver(device)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: driver)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: device.capturing)
    pool = HostBufferPool(pin=True)
    buf = pool.acquire(1 << 16)
    pool.wait_registered()
    ptr, cycle = buf.data.data_ptr(), [buf]
    cycle.append(cycle)
    del buf, cycle
    device.capturing = True
    gc.collect()
    pool.collect()   # a safe point asked for inside the capture does nothing
    device.capturing = False
    assert driver.unregistered == [] and len(pool.releases) == 1
    pool.collect()
    assert driver.unregistered == [(ptr, False)]


def test_work_left_in_a_dropped_queue_runs_at_the_next_safe_point_of_another():
    """An owner dropped without close (an engine a test lets go): what its queue held
    is neither lost nor freed undone (a registered buffer unmapped while the driver still
    has it registered); the next `run` of any queue does it."""
    class Memory:   # what an unregistration keeps alive until it is done
        pass

    done = []
    memory = Memory()
    alive = weakref.ref(memory)
    dropped = ReleaseQueue()
    dropped.put(lambda m: done.append(type(m).__name__), memory)
    del memory, dropped
    gc.collect()
    assert done == [] and alive() is not None
    assert ReleaseQueue().run() == 1
    assert done == ["Memory"] and alive() is None
