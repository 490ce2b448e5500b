"""The host reserve (engine/lora/host_reserve.py): buffers of a full host copy's size made
ahead up to a budget, taken by `acquire` (an exact size first), counted, page-locking held
and resumed, and both threads gone after `close`."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from loramux_engine.lora import load_lora
from loramux_engine.lora.host_buffers import HostBufferPool
from loramux_engine.lora.host_reserve import HostReserve
from loramux_engine.lora.weights import full_copy_bytes
from loramux_core.model.hf_config import ModelConfig
from tests.support.tiny import AdapterSpec, make_adapter, make_model

SIZE = 5 << 16   # five granules: a size class of its own


def wait_complete(reserve: HostReserve, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not reserve.complete:
        assert time.monotonic() < deadline, f"reserve not complete: {reserve.counters()}"
        time.sleep(0.01)


def reserve_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("host-reserve")]


class Recording(HostBufferPool):
    """A pool that remembers the sizes asked of it."""

    def __init__(self):
        super().__init__()
        self.asked: list[int] = []

    def acquire(self, nbytes: int):
        self.asked.append(nbytes)
        return super().acquire(nbytes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_copy_bytes_is_what_a_real_full_rank_load_asks_for(tmp_path, dtype):
    """A reserve buffer is exactly what an adapter wrapping every target at max rank asks
    for, so such a load takes it as an exact match; a smaller adapter asks for less."""
    model = make_model(tmp_path / "model")
    mc = ModelConfig.from_dir(model)
    full = make_adapter(tmp_path / "full", model, AdapterSpec(r=16, seed=1))
    small = make_adapter(tmp_path / "small", model, AdapterSpec(
        r=4, rank_pattern={"k_proj": 8}, target_modules=("q_proj", "k_proj", "down_proj"),
        seed=2))
    pool = Recording()
    load_lora(full, mc, 16, dtype=dtype, buffers=pool)
    load_lora(small, mc, 16, dtype=dtype, buffers=pool)
    assert pool.asked[0] == full_copy_bytes(mc, 16, 1, dtype)
    assert pool.asked[1] < pool.asked[0]


def test_reserve_made_up_to_n_then_taken_by_acquire():
    pool = HostBufferPool()
    reserve = HostReserve(pool, SIZE - 100, 3)
    reserve.start()
    wait_complete(reserve)
    assert reserve.counters() == {"host_reserve_target": 3, "host_reserve_ready": 3,
                                  "host_reserve_taken": 0}
    assert pool.num_free == 3 and pool.allocated_bytes == 3 * SIZE
    smaller = pool.acquire(2 << 16)    # no buffer of its size: a reserve one
    assert smaller.nbytes == SIZE and pool.num_allocations == 0
    assert reserve.counters()["host_reserve_taken"] == 1
    beside = pool.acquire(1 << 16, reserve=False)   # not a host copy: allocated
    assert beside.nbytes == 1 << 16 and pool.num_allocations == 1
    pool.release(smaller)
    again = pool.acquire(2 << 16)      # reused: not taken from the reserve twice
    assert again is smaller and reserve.counters()["host_reserve_taken"] == 1
    full = [pool.acquire(SIZE) for _ in range(2)]
    assert all(b.nbytes == SIZE for b in full) and pool.num_allocations == 1
    assert reserve.counters()["host_reserve_taken"] == 3
    pool.acquire(SIZE)                 # the reserve is spent: allocated as before
    assert pool.num_allocations == 2
    reserve.close()
    assert not reserve_threads()


def test_a_free_buffer_of_the_exact_size_goes_before_a_reserve_one():
    pool = HostBufferPool()
    own = pool.acquire(2 << 16)
    reserve = HostReserve(pool, SIZE, 3)
    reserve.start()
    wait_complete(reserve)
    pool.release(own)
    assert pool.acquire(2 << 16) is own
    assert reserve.counters()["host_reserve_taken"] == 0
    assert pool.acquire(2 << 16).nbytes == SIZE      # then a reserve one
    reserve.close()


def test_reserve_never_exceeds_its_budget_with_what_loads_allocated():
    """Buffers loads allocated before the reserve ran count against it."""
    pool = HostBufferPool()
    taken = [pool.acquire(SIZE), pool.acquire(SIZE)]
    reserve = HostReserve(pool, SIZE, 3)
    reserve.start()
    wait_complete(reserve)
    assert reserve.counters()["host_reserve_target"] == 1
    assert reserve.counters()["host_reserve_ready"] == 1
    assert pool.allocated_bytes == 3 * SIZE and pool.num_free == 1
    reserve.close()
    del taken


def test_page_locking_paced_while_the_engine_is_busy_back_to_back_when_idle():
    """A lock share so small that one registration's pause lasts for ever while the
    engine is busy: one buffer is locked, then none until the engine is idle; `close`
    ends a pause."""
    busy = threading.Event()
    busy.set()
    pool = HostBufferPool(pin=True)
    reserve = HostReserve(pool, SIZE, 3, lock_share=1e-12)
    reserve.start(busy=busy.is_set)
    deadline = time.monotonic() + 60
    while reserve.counters()["host_reserve_ready"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)
    assert reserve.counters()["host_reserve_ready"] == 1 and not reserve.complete
    busy.clear()
    wait_complete(reserve)
    assert reserve.counters()["host_reserve_ready"] == 3
    reserve.close()
    busy.set()
    paused = HostReserve(HostBufferPool(pin=True), SIZE, 3, lock_share=1e-12)
    paused.start(busy=busy.is_set)
    while paused.counters()["host_reserve_ready"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    paused.close()
    assert not reserve_threads() and not paused.complete


def test_page_locking_held_then_resumed_and_loads_take_unlocked_buffers():
    """pin=True: populated buffers wait for page-locking while held (graph capture); a
    load may take one meanwhile; once resumed every buffer is accounted for. (On a machine
    without CUDA registration fails and the buffers stay pageable: the path is the same.)"""
    pool = HostBufferPool(pin=True)
    reserve = HostReserve(pool, SIZE, 4, held=True)
    reserve.start()
    deadline = time.monotonic() + 60
    while pool.allocated_bytes < 4 * SIZE or pool.reserving:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert pool.num_free == 0                    # populated, none locked: held
    assert reserve.counters()["host_reserve_ready"] == 0 and not reserve.complete
    early = pool.acquire(SIZE)                   # a load takes an unlocked one
    assert pool.num_allocations == 0 and pool.num_unpinned_taken == 1
    pool.wait_registered()                       # the pool had it locked itself
    assert early.pin_tried
    reserve.resume()
    wait_complete(reserve)
    assert reserve.counters() == {"host_reserve_target": 4, "host_reserve_ready": 4,
                                  "host_reserve_taken": 1}
    assert pool.num_free == 3
    reserve.close()
    assert not reserve_threads()


def test_close_ends_both_threads_while_held_and_while_filling():
    pool = HostBufferPool(pin=True)
    held = HostReserve(pool, SIZE, 2, held=True)
    held.start()
    held.close()                      # the pin thread waits, held: it must still end
    assert not reserve_threads() and not held.complete
    big = HostReserve(HostBufferPool(), SIZE, 100_000)   # 20 GB if it were not stopped
    big.start()
    big.close()
    assert not reserve_threads() and not big.complete
    assert big.pool.allocated_bytes < 100 * SIZE


class RunsOut(HostBufferPool):
    """A pool whose memory runs out after `left` reserve buffers."""

    def __init__(self, left: int):
        super().__init__()
        self.left = left

    def allocate_reserved(self, size: int, budget_bytes: int):
        if self.left == 0:
            raise MemoryError("no memory left")
        self.left -= 1
        return super().allocate_reserved(size, budget_bytes)


def test_memory_running_out_ends_the_reserve_with_what_was_made():
    lines = []
    reserve = HostReserve(RunsOut(2), SIZE, 5, log=lines.append)
    reserve.start()
    wait_complete(reserve)
    assert reserve.counters() == {"host_reserve_target": 2, "host_reserve_ready": 2,
                                  "host_reserve_taken": 0}
    assert reserve.pool.num_free == 2 and not reserve.pool.reserving
    assert lines[0].startswith("engine: host reserve: making 5 buffers of 0.3 MB")
    assert "stopped after 2 buffers: MemoryError('no memory left')" in lines[1]
    assert lines[2].startswith("engine: host reserve complete: 2 buffers")
    reserve.close()


def test_the_reserve_leaves_the_host_its_floor_of_available_memory():
    """Engines starting together each sized their host tier from the memory available
    before the others' reserves took it: a reserve stops where the host's is low."""
    pool, lines = HostBufferPool(), []
    reserve = HostReserve(pool, SIZE, 5, log=lines.append,
                          room=lambda: 2 * SIZE - pool.allocated_bytes)
    reserve.start()
    wait_complete(reserve)
    assert reserve.counters()["host_reserve_target"] == 2 and pool.num_free == 2
    assert any("fell to its floor" in line and "after 2 buffers" in line for line in lines)
    reserve.close()
