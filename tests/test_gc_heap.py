"""The cyclic collector in serving processes (loramux_core/gc_heap.py): every process of
`loramux serve` freezes its start-up heap before it reports ready, so that a full
collection never walks the model, kernels and modules again; decode steps make no
reference cycles, so what they leave is freed by reference counting alone, not by the
collector; and the engine's events carry the time of its collections (a histogram)."""
from __future__ import annotations

import gc

from loramux_engine import Engine, EngineConfig, SamplingParams
from loramux_engine.telemetry import GcPauses
from loramux_core.gc_heap import freeze_heap
from loramux_services.launcher import Cluster
from loramux_services.serve_args import cluster_config, files, parse_args
from tests.support.served import ServedEngine
from tests.support.tiny import TinySpec, make_model


def test_freeze_heap_freezes_what_is_alive():
    try:
        held = [object()]  # a tracked container made before the freeze
        frozen = freeze_heap()
        # frozen objects may still die (another thread of the test process drops one): the
        # count never grows back without another freeze
        assert 0 < gc.get_freeze_count() <= frozen
        assert not any(o is held for o in gc.get_objects())  # the collector skips it
    finally:
        gc.unfreeze()


def test_every_served_process_freezes_its_start_up_heap(tmp_path):
    model = make_model(tmp_path / "model", TinySpec())
    args = parse_args(["--model", str(model), "--device", "cpu", "--max-num-seqs", "4",
                       "--cpu-threads", "1", "--metrics-port", "-1", "--gateway-port", "0",
                       "--control-port", "0", "--http-port", "0",
                       "--workdir", str(tmp_path / "run")])
    c = Cluster(cluster_config(args, files(args)))
    c.cfg.env["OMP_NUM_THREADS"] = "1"
    c.start()
    try:
        ready = c.wait_ready()
    finally:
        c.close()
    assert set(ready) == {"engine", "control", "gateway"}
    for name, info in ready.items():
        assert info["gc_frozen"] > 0, (name, info)


def test_decode_steps_make_no_reference_cycles(tmp_path):
    """Requests from admission through prefill, decode and finish (and an abort) leave
    nothing for the cyclic collector: with it off, a collection afterwards finds none.
    On CUDA that also says the warm-up compiled every kernel variant the steps launch (a
    Triton compile leaves thousands of cycles)."""
    model = make_model(tmp_path / "model", TinySpec())
    eng = Engine(EngineConfig(model=str(model), max_num_seqs=8, num_kv_blocks=64,
                              enforce_eager=True, async_scheduling=True, cpu_threads=1))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    try:
        eng.warm_up()                      # as a server does before its first request
        eng.generate([[5, 6, 7]], params)  # first-use caches are built before counting
        gc.collect()
        gc.disable()
        try:
            for i in range(8):
                eng.add_request(f"r{i}", [3 + i, 9, 11, 40 + i], params)
            for _ in range(6):
                eng.step()
            eng.abort("r0")
            while eng.has_unfinished():
                eng.step()
            found = gc.collect()
        finally:
            gc.enable()
        assert found == 0
    finally:
        eng.close()


def test_gc_pauses_times_collections_while_installed():
    with GcPauses() as pauses:
        gc.collect()
        seen = pauses.histogram.count
        assert seen >= 1 and pauses.histogram.sum > 0
    gc.collect()
    assert pauses.histogram.count == seen  # the callback is gone


def test_engine_events_carry_the_engine_process_collections(tmp_path):
    model = make_model(tmp_path / "model", TinySpec())
    eng = Engine(EngineConfig(model=str(model), max_num_seqs=4, num_kv_blocks=32,
                              cpu_threads=1))

    def counted(msg) -> bool:
        if msg.WhichOneof("kind") != "event":
            return False
        h = {x.name: x for x in msg.event.histograms}.get("gc_pause_seconds")
        return h is not None and sum(h.bucket_counts) >= 1

    try:
        with ServedEngine(eng) as served:
            gc.collect()  # one collection in the engine's process while it serves
            served.collect(counted)
    finally:
        eng.close()
