"""engine/precompile.py, the parts a CPU can run: the dry run lists each variant Triton
is asked to compile once and has it skipped; a worker process compiles its share and
counts the variants it could not compile (here: every one, there is no GPU) without
failing, also when it is fed while the listing runs; the cache mark is keyed by everything that picks variants; an engine on the CPU
has nothing to precompile. The GPU path (variants listed, compiled in parallel, the
warm-up then loading every one from the disk cache) is measured by
benchmarks/bench_startup.py, whose warm-up line counts the variants compiled there."""
import dataclasses
import json
import time

import pytest

from loramux_engine.config import EngineConfig
from loramux_engine.precompile import (_Workers, default_workers, fingerprint, list_variants, precompile,
                               read_mark)
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
    found = []
    assert list_variants(run, found=found.append) == [
        ("kernels.m", "a", "1"), ("kernels.m", "b", "1"), ("kernels.m", "a", "2")]
    assert found == list_variants(run)   # each new one handed on once, in order
    assert knobs.runtime.jit_cache_hook is before


def test_workers_compile_what_they_are_fed_and_count_what_they_could_not(tmp_path):
    """Variants sent while the listing runs reach the workers in turn; each worker counts
    what it could not compile (here every one: no GPU, or no such kernel) and exits
    cleanly when its input ends; the total is every variant sent."""
    workers = _Workers(2, tmp_path)
    bad = [("loramux_kernels.elementwise_kernels_triton", "no_such_kernel", "{}"),
           ("no.such.module", "k", "{}"), ("no.such.module", "k2", "{}")]
    for variant in bad:
        workers.send(variant)
    assert workers.finish(None, time.monotonic() + 120) == 3
    assert [p.returncode for p in workers.procs] == [0, 0]


def test_a_worker_that_dies_counts_every_variant_it_was_sent(tmp_path, capfd):
    workers = _Workers(2, tmp_path)
    workers.procs[1].kill()
    for i in range(3):
        workers.send(("no.such.module", f"k{i}", "{}"))
    # worker 0 got k0 and k2 and could not compile them; worker 1 died with k1
    assert workers.finish(None, time.monotonic() + 120) == 3
    assert "engine precompile worker exited -9" in capfd.readouterr().err


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
    from loramux_engine.engine import Engine

    eng = Engine(EngineConfig(model=str(llama_family.model_dir), device="cpu", max_loras=2,
                              num_kv_blocks=16, max_num_batched_tokens=16))
    assert precompile(eng, workers=4) is None
    assert default_workers(16) == 8 and default_workers(2) == 1 and default_workers(1) == 0


def test_the_cache_mark_keeps_the_covering_shapes(tmp_path):
    from loramux_engine.warmup import EagerShape

    shapes = (EagerShape(1, 1, 0, True), EagerShape(66, 17, 233, True, spread=False))
    mark = tmp_path / "mark"
    mark.write_text(json.dumps({"variants": 9, "shapes": [dataclasses.astuple(s) for s in shapes]}))
    assert read_mark(mark) == shapes
    mark.write_text("90 variants\n")   # a mark of an older version: every shape runs
    assert read_mark(mark) is None
    assert read_mark(tmp_path / "absent") is None
