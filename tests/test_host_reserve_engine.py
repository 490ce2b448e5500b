"""An engine with a small host reserve: adapters read by its loader processes into the
reserved shared buffers give Hugging Face + PEFT's greedy tokens, and its counters say
so (engine/lora/host_reserve.py)."""
from __future__ import annotations

import time

import pytest

from loramux_engine import Engine, EngineConfig
from loramux_engine.server.events import engine_counters
from tests.test_engine_parity import (ADAPTERS, CHUNK, GREEDY, LENGTHS, MAX_NEW,
                                      assert_matches, prompts_of)

pytestmark = pytest.mark.timeout(600)


def test_loads_take_the_reserved_buffers_and_match_peft(llama_family, llama_oracle):
    """Two reserved buffers for a host tier of two; three adapters of ranks below the
    maximum (each takes a larger reserved buffer), one slot, so adapters are evicted
    from the host tier and read back."""
    config = EngineConfig(model=str(llama_family.model_dir), device="cpu", dtype="float32",
                          max_loras=1, max_cpu_loras=2, max_lora_rank=64,
                          max_num_batched_tokens=CHUNK, block_size=8, num_kv_blocks=256,
                          adapter_loaders=2, host_reserve_loras=2)
    with Engine(config) as eng:
        reserve = eng.host_reserve
        deadline = time.monotonic() + 120
        while not reserve.complete:
            assert time.monotonic() < deadline, reserve.counters()
            time.sleep(0.05)
        pool = eng.adapter_loaders.buffers
        assert pool.shared and pool.num_free == 2 and pool.num_allocations == 0
        for name, path in llama_family.adapters.items():
            eng.add_adapter(name, path)
        prompts = prompts_of(LENGTHS, seed=7)
        refs = llama_oracle.generate(prompts, ADAPTERS, MAX_NEW)
        assert_matches(eng.generate(prompts, GREEDY, ADAPTERS), refs)
        stats = eng.stats()
        assert sum(a["disk_reads"] for a in stats["adapters"].values()) >= 1
        counters = engine_counters(stats)
        assert (counters.host_reserve_target, counters.host_reserve_ready,
                counters.host_reserve_taken) == (2, 2, 2)
        # every host copy lay in a reserved buffer: none of the adapters' size was made
        # the third adapter is read while both reserved buffers hold a copy (a host copy
        # goes once the read that displaces it has landed): that read alone allocated;
        # the reads back after eviction reused what the evicted copies freed
        assert pool.num_allocations == 1 and pool.num_reuses >= 3


def test_a_buffer_beside_the_host_copy_never_takes_a_reserved_one(tmp_path, llama_family):
    """An adapter with LoRA on lm_head: its loader process asks for the host copy, then
    for a buffer of the end factors beside it; only the copy takes a reserved buffer."""
    from tests.support.tiny import AdapterSpec, make_adapter

    head = make_adapter(tmp_path / "head", llama_family.model_dir,
                        AdapterSpec(r=8, seed=4, target_modules=("v_proj", "lm_head")))
    config = EngineConfig(model=str(llama_family.model_dir), device="cpu", dtype="float32",
                          max_loras=1, max_cpu_loras=2, max_lora_rank=16,
                          num_kv_blocks=64, adapter_loaders=2, host_reserve_loras=2)
    with Engine(config) as eng:
        deadline = time.monotonic() + 120
        while not eng.host_reserve.complete:
            assert time.monotonic() < deadline, eng.host_reserve.counters()
            time.sleep(0.05)
        eng.add_adapter("head", head)
        pool = eng.adapter_loaders.buffers
        assert eng.host_reserve.counters()["host_reserve_taken"] == 1
        assert pool.num_allocations == 1 and pool.num_free == 1   # the end factors' own
