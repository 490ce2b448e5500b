"""engine/precompile.py, the parts a CPU can run: the dry run lists each variant Triton
is asked to compile once and has it skipped; a worker process compiles its share and
counts the variants it could not compile (here: every one, there is no GPU) without
failing; the cache mark is keyed by everything that picks variants; an engine on the CPU
has nothing to precompile. The GPU path (variants listed, compiled in parallel, the
warm-up then loading every one from the disk cache) is measured by
benchmarks/bench_startup.py, whose warm-up line counts the variants compiled there."""
import dataclasses
import json
import subprocess
import sys

import pytest

from engine.config import EngineConfig
from engine.precompile import default_workers, fingerprint, list_variants, precompile
from triton import knobs


def test_the_dry_run_lists_each_variant_once_and_skips_its_compile():
    class Info:
        def __init__(self, module, name):
            self.module, self.name = module, name

    def run():
        hook = knobs.runtime.jit_cache_hook
        answers = [hook(key=k, repr="", fn=Info("kernels.m", f), is_manual_warmup=False,
                        already_compiled=False, compile={"specialization_data": spec})
                   for k, (f, spec) in enumerate([("a", "1"), ("b", "1"), ("a", "1"),
                                                   ("a", "2")])]
        assert answers == [True] * 4   # skipped: neither compiled nor launched

    before = knobs.runtime.jit_cache_hook
    assert list_variants(run) == [("kernels.m", "a", "1"), ("kernels.m", "b", "1"),
                                  ("kernels.m", "a", "2")]
    assert knobs.runtime.jit_cache_hook is before


def test_a_worker_counts_what_it_could_not_compile_and_exits_cleanly(tmp_path):
    share = tmp_path / "share.json"
    share.write_text(json.dumps([["kernels.elementwise_kernels_triton", "no_such_kernel", "{}"],
                                 ["no.such.module", "k", "{}"]]))
    done = subprocess.run([sys.executable, "-m", "engine.precompile", str(share)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2"
    assert "no_such_kernel" in done.stderr and "no.such.module" in done.stderr


def test_the_cache_mark_follows_what_picks_variants(llama_family):
    config = EngineConfig(model=str(llama_family.model_dir), device="cuda", dtype="bfloat16",
                          max_loras=4, max_num_seqs=8)
    same = dataclasses.replace(config)
    assert fingerprint(config) == fingerprint(same)
    for change in (dict(max_num_seqs=16), dict(max_loras=8), dict(max_lora_rank=32),
                   dict(lora_extras=("dora",)), dict(dtype="float16")):
        assert fingerprint(dataclasses.replace(config, **change)) != fingerprint(config), change
    # sized from the memory free at start: a restarted replica must find its mark
    for change in (dict(max_cpu_loras=1578), dict(num_kv_blocks=34391),
                   dict(gpu_memory_utilization=0.8), dict(adapter_loaders=8)):
        assert fingerprint(dataclasses.replace(config, **change)) == fingerprint(config), change


@pytest.mark.engine_device("cpu")  # the device it names, whatever the suite's
def test_the_cpu_has_nothing_to_precompile(llama_family):
    from engine.engine import Engine

    eng = Engine(EngineConfig(model=str(llama_family.model_dir), device="cpu", max_loras=2,
                              num_kv_blocks=16, max_num_batched_tokens=16))
    assert precompile(eng, workers=4) is None
    assert default_workers(16) == 8 and default_workers(2) == 1 and default_workers(1) == 0
