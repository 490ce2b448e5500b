"""The adapter lifecycle under random traffic: the model-based stress of the real engine
(tests/support/lifecycle_stress.py), short runs with fixed seeds and few slots and host
copies, sync and async scheduling. The long run is benchmarks/stress_lifecycle.py. (With
the host tier and read budget of before the progress fix, seeds 0-2 at max_loras=1,
max_cpu_loras=1 broke the waiting bound within 300 operations.)"""
import pytest

from tests.support.lifecycle_stress import LifecycleStress, StressConfig, references
from tests.support.tiny import AdapterSpec, make_adapter

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def weights(llama_family, tmp_path_factory):
    root = tmp_path_factory.mktemp("stress")
    extra = {f"x{i}": make_adapter(root / f"x{i}", llama_family.model_dir,
                                   AdapterSpec(r=4 + 4 * i, lora_alpha=16, seed=70 + i))
             for i in range(2)}
    return {**llama_family.adapters, **extra}


@pytest.fixture(scope="module")
def refs(llama_family, weights):
    return references(llama_family.model_dir, weights, MAX_TOKENS)


@pytest.mark.parametrize("cfg,seed,ops", [
    (StressConfig(max_loras=2, max_cpu_loras=2), 1, 300),
    (StressConfig(max_loras=1, max_cpu_loras=1, async_scheduling=True), 2, 200),
])
def test_stress_lifecycle(llama_family, weights, refs, cfg, seed, ops):
    run = LifecycleStress(cfg, llama_family.model_dir, weights, refs, seed)
    try:
        stats = run.run(ops)
    finally:
        run.close()
    print(f"seed={seed} {cfg}: {dict(stats.ops)} {stats}")
    assert stats.finished > ops // 20 and stats.refused > 5, stats
    assert run.tiers_seen >= {"evictions", "host_evictions", "disk_reads"}, run.tiers_seen
