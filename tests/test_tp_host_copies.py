"""Host copies of adapters evicted and read back from disk under tensor parallelism: the
same tokens at TP=2 as at TP=1. A file of its own because it builds its own engines: on
CUDA one process holds one TP engine at a time (engine/distributed/group.py), and the
shared engines of tests/test_tp_engine.py live until that module ends."""
from __future__ import annotations

from loramux_engine import Engine, EngineConfig
from tests.test_tp_engine import CFG, PROMPTS, assert_same, run_all


def test_host_copies_evicted_and_read_back_from_disk_match_tp1(llama_family):
    """max_cpu_loras=2 for 3 adapters: host copies are evicted (on rank 0, and on the
    workers through HOST_DROP) and read back from disk by every rank when a request names
    them again; TP=2 still gives the TP=1 tokens."""
    names = ["rs4", "ap8", "attn32"]
    waves = [[(f"w{w}-{i}", PROMPTS[(w + 2 * i) % 7], names[(w + i) % 3]) for i in range(3)]
             for w in range(3)]
    results, stats = {}, {}
    for tp in (1, 2):
        with Engine(EngineConfig(model=str(llama_family.model_dir), tp_size=tp,
                                 **{**CFG, "max_cpu_loras": 2})) as engine:
            for name in names:
                engine.add_adapter(name, llama_family.adapters[name])
            # one request at a time per wave member so adapters take turns in host memory
            results[tp] = {}
            for wave in waves:
                for req in wave:
                    results[tp].update(run_all(engine, [req])["outputs"])
            stats[tp] = engine.stats()
    assert_same(results[1], results[2])
    for tp in (1, 2):
        assert stats[tp]["host_copies"] <= 2
        per = stats[tp]["adapters"].values()
        assert sum(a["host_evictions"] for a in per) >= 3, "no host copy was evicted"
        assert sum(a["disk_reads"] for a in per) >= 3, "no adapter was read back from disk"
    drop = ("state", "slot")
    assert [{k: v for k, v in a.items() if k not in drop} for a in stats[1]["adapters"].values()] \
        == [{k: v for k, v in a.items() if k not in drop} for a in stats[2]["adapters"].values()]
