"""Adapter reads in loader processes (engine/adapters/loader_pool.py): the host copy a
child writes into the engine's shared buffers is the in-process read's, bit for bit,
whatever the buffers held before (poisoned with NaN); every refusal of the hostile corpus
is the same error with the same message; a child that dies or hangs fails only the read
it was doing and is replaced; shared memory goes back when host copies go; the children
die with the engine. Real files (tests/support/tiny.py), real processes."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from loramux_engine.adapters.loader_pool import LoaderPool, LoaderSpec
from loramux_engine.adapters.loader_wire import describe, rebuild
from loramux_engine.lora import load_lora
from loramux_engine.lora.host_buffers import HostBufferPool
from loramux_engine.parallel import TPGroup
from loramux_core.errors import AdapterError
from loramux_core.model.hf_config import ModelConfig
from loramux_core.model.lora_targets import lora_group_shapes
from loramux_core.safe_files import AdapterRoots
from tests.support.adapter_fuzz import path_attacks, write_corpus
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

pytestmark = pytest.mark.timeout(600)
RANK = 16
MOE = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("loaders")
    model = make_model(root / "model", TinySpec(tie_word_embeddings=False))
    adapters = root / "adapters"
    specs = {"a": AdapterSpec(r=8, seed=1), "b": AdapterSpec(r=4, seed=2),
             "mixed": AdapterSpec(r=4, rank_pattern={"k_proj": 8}, seed=3,
                                  target_modules=("q_proj", "k_proj", "down_proj")),
             "head": AdapterSpec(r=8, seed=4, target_modules=("v_proj", "lm_head"))}
    paths = {n: make_adapter(adapters / n, model, s) for n, s in specs.items()}
    # filled layer by layer (engine/lora/stacked_fill.py takes neither)
    paths["dora"] = make_adapter(adapters / "dora", model, AdapterSpec(r=4, seed=6),
                                 use_dora=True)
    paths["one_layer"] = make_adapter(adapters / "one_layer", model, AdapterSpec(r=4, seed=7),
                                      layers_to_transform=[1])
    moe_model = make_model(root / "moe-model", TinySpec(arch="qwen2_moe"))
    paths["moe"] = make_adapter(adapters / "moe", moe_model, AdapterSpec(
        r=4, seed=5, target_modules=("q_proj",), target_parameters=MOE))
    return {"root": root, "model": model, "moe_model": moe_model, "adapters": adapters,
            "paths": paths}


def make_pool(model, roots=(), tp=TPGroup.single(), dtype=torch.float32, **kw):
    mc = ModelConfig.from_dir(model)
    spec = LoaderSpec(str(model), RANK, str(dtype).split(".")[-1], tuple(map(str, roots)),
                      tp.rank, tp.size)
    return LoaderPool(spec, HostBufferPool(shared=True), lora_group_shapes(mc, tp.size),
                      dtype, **kw)


def poison(buffers: HostBufferPool, sizes) -> None:
    """Free buffers of `sizes` full of NaN: the next reads get them back."""
    bufs = [buffers.acquire(n) for n in sizes]
    for b in bufs:
        b.data.view(torch.float32).fill_(float("nan"))
    for b in bufs:
        buffers.release(b)


def all_tensors(w) -> dict:
    out = {("buf",): w.buffer.data[:w.buffer_bytes]} if w.buffer is not None else {}
    for k, g in w.groups.items():
        out[k + ("a",)], out[k + ("b",)] = g.a, g.b
        if g.magnitude is not None:
            out[k + ("m",)] = g.magnitude
    for k, (a, b) in {**w.stacked, **w.ends, **w.experts}.items():
        out[(k, "A")], out[(k, "B")] = a, b
    return out


def assert_same(got, want) -> None:
    for field in ("num_layers", "max_rank", "target_modules", "tp_rank", "tp_size",
                  "source", "version", "shapes"):
        assert getattr(got, field) == getattr(want, field), field
    for k in ("groups", "stacked", "ends", "experts"):
        assert getattr(got, k).keys() == getattr(want, k).keys(), k
    g, w = all_tensors(got), all_tensors(want)
    assert g.keys() == w.keys()
    for k in w:
        assert g[k].dtype == w[k].dtype and g[k].shape == w[k].shape, k
        assert torch.equal(g[k], w[k]), k
    assert [gw.slice_ranks for gw in got.groups.values()] == \
        [gw.slice_ranks for gw in want.groups.values()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_loaded_copy_is_the_in_process_copy_over_poisoned_buffers(files, dtype):
    model, paths = files["model"], files["paths"]
    mc = ModelConfig.from_dir(model)
    for tp in (TPGroup.single(), TPGroup(1, 2)):
        pool = make_pool(model, tp=tp, dtype=dtype)
        try:
            want = {n: load_lora(paths[n], mc, RANK, tp=tp, dtype=dtype)
                    for n in ("a", "b", "mixed", "head", "dora", "one_layer")}
            poison(pool.buffers, [w.buffer.nbytes for w in want.values()] * 2)
            for name, w in want.items():
                got = pool.read(str(paths[name]), w.version)
                assert got.buffer.shared is not None  # written by the child, in place
                assert_same(got, w)
        finally:
            pool.close()


def test_expert_factors_cross_too(files):
    mc = ModelConfig.from_dir(files["moe_model"])
    pool = make_pool(files["moe_model"])
    try:
        want = load_lora(files["paths"]["moe"], mc, RANK)
        assert want.experts
        poison(pool.buffers, [want.buffer.nbytes, 1 << 16, 1 << 17])
        assert_same(pool.read(str(files["paths"]["moe"]), None), want)
    finally:
        pool.close()


def test_a_described_layer_outside_the_stacked_tensors_is_refused(files):
    """The engine builds a group's factors as rows of its stacked tensors, by the layer
    a loader names: a layer they do not hold is nonsense, not a view elsewhere."""
    mc = ModelConfig.from_dir(files["model"])
    w = load_lora(files["paths"]["a"], mc, RANK)
    bases = [w.buffer.data]
    desc = describe(w, bases)
    assert_same(rebuild(desc, bases, w.shapes, torch.float32, w.buffer), w)
    for layer in (-1, mc.num_layers, "0", None):
        bad = json.loads(json.dumps(desc))
        bad["groups"][0][0] = layer
        with pytest.raises(ValueError, match="which its stacked tensors do not hold"):
            rebuild(bad, bases, w.shapes, torch.float32, w.buffer)


def _outcome(read, path):
    try:
        read(path)
        return "ok"
    except Exception as e:
        return type(e).__name__, str(e), getattr(e, "feature", None), getattr(e, "file", None)


def test_every_refusal_is_the_in_process_one(files, tmp_path):
    """The hostile corpus and every path attack, read inside one root both ways: the
    same error type, message, feature and file, each case in bounded time."""
    root = tmp_path / "root"
    good = make_adapter(root / "good", files["model"], AdapterSpec(seed=9))
    outside = tmp_path / "outside"
    import shutil
    from tests.support.adapter_fuzz import CANARY
    shutil.copytree(good, outside / CANARY)
    cases = write_corpus(root, good, outside) + path_attacks(root, outside, "good")
    mc, roots = ModelConfig.from_dir(files["model"]), AdapterRoots([str(root)])
    pool = make_pool(files["model"], roots=[root], timeout_s=60.0)
    try:
        differ, slow = [], []
        for c in cases:
            want = _outcome(lambda p: load_lora(p, mc, RANK, roots=roots), c.path)
            t0 = time.monotonic()
            got = _outcome(lambda p: pool.read(p, None), c.path)
            if time.monotonic() - t0 > 30:
                slow.append(c.name)
            if got != want:
                differ.append(f"{c.name} {c.what}: {got} != {want}")
        assert not differ, "\n".join(differ[:20])
        assert not slow
        assert pool.num_replaced == 0  # a refusal is an answer, not a failure
    finally:
        pool.close()


def _read_in_thread(pool, path, **kw):
    """Start `pool.read(path)` on a thread; returns once it holds an idle child."""
    idle = pool.num_idle
    out = {}

    def run():
        try:
            out["weights"] = pool.read(path, None, **kw)
        except Exception as e:
            out["error"] = e
    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 120
    while pool.num_idle == idle and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)  # until the thread took the child (a condition, not a delay)
    return t, out


@contextlib.contextmanager
def _pool_with_signalled_child(files, processes: int, sig: int):
    """A pool of `processes` children whose first, once it made a read, got `sig`
    (SIGSTOP: it takes the next read and never answers; SIGKILL: it died idle).
    Yields (pool, that child's pid)."""
    pool = make_pool(files["model"], processes=processes)
    try:
        pool.read(str(files["paths"]["a"]), None)
        (child,) = pool.pids()
        os.kill(child, sig)
        yield pool, child
    finally:
        pool.close()


def _failed_read(t, out) -> AdapterError:
    """The error of the read on thread `t` (_read_in_thread), once it ended: the pool's
    own, not the adapter's."""
    t.join()
    err = out["error"]
    assert isinstance(err, AdapterError) and err.feature == "loader_process"
    return err


def test_a_child_that_dies_fails_only_its_read_and_is_replaced(files):
    b = str(files["paths"]["b"])
    # the stopped child takes the next read and never answers
    with _pool_with_signalled_child(files, 1, signal.SIGSTOP) as (pool, victim):
        t, out = _read_in_thread(pool, b)
        os.kill(victim, signal.SIGKILL)
        err = _failed_read(t, out)
        assert "died" in str(err) and b in str(err)
        assert pool.num_replaced == 1
        w = pool.read(b, None)   # a fresh child
        assert pool.pids() != [victim] and w.version


def test_a_child_that_hangs_is_stopped_and_others_serve_meanwhile(files):
    b = files["paths"]["b"]
    with _pool_with_signalled_child(files, 2, signal.SIGSTOP) as (pool, stuck):
        t, out = _read_in_thread(pool, str(b), timeout_s=1.0)
        assert "in time" in str(_failed_read(t, out))
        assert stuck not in pool.pids() and pool.num_replaced == 1
        with pytest.raises(ProcessLookupError):   # killed and reaped
            os.kill(stuck, 0)
        assert_same(pool.read(str(b), None),
                    load_lora(b, ModelConfig.from_dir(files["model"]), RANK))


def test_a_stuck_child_holds_up_no_other_read(files):
    paths = files["paths"]
    with _pool_with_signalled_child(files, 2, signal.SIGSTOP) as (pool, stuck):
        t, out = _read_in_thread(pool, str(paths["b"]))  # waits on the stopped child
        w = pool.read(str(paths["mixed"]), None)          # a second child serves this one
        assert w.version and "weights" not in out and "error" not in out
        os.kill(stuck, signal.SIGCONT)
        t.join()
        assert out["weights"].version


def test_a_child_that_died_idle_is_replaced_not_handed_out(files):
    with _pool_with_signalled_child(files, 1, signal.SIGKILL) as (pool, dead):
        deadline = time.monotonic() + 120
        while not _exited(dead) and time.monotonic() < deadline:
            time.sleep(0.01)  # until it is gone (a condition, not a delay)
        assert pool.read(str(files["paths"]["b"]), None).version  # a fresh child read it
        assert pool.pids() != [dead] and pool.num_replaced == 1


def _exited(pid: int) -> bool:
    """Our child `pid` has ended and waits to be reaped (left unreaped here). Not its
    state in /proc: a leader shows Z while its other threads still exit."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def test_children_started_ahead_serve_the_first_reads(files):
    pool = make_pool(files["model"], processes=2)
    try:
        pool.start_in_background().join()
        started = pool.pids()
        assert len(started) == 2 and pool.num_idle == 2
        pool.read(str(files["paths"]["a"]), None)
        assert pool.pids() == started
    finally:
        pool.close()


def test_some_children_ahead_the_rest_later(files):
    """The engine server starts a few children during its warm-up and the rest after."""
    pool = make_pool(files["model"], processes=3)
    try:
        pool.start_in_background(up_to=1).join()
        assert len(pool.pids()) == 1 and pool.num_idle == 1
        pool.start_in_background().join()
        assert len(pool.pids()) == 3 and pool.num_idle == 3
    finally:
        pool.close()


def test_children_run_at_a_lower_priority_than_the_engine(files):
    """A loader gets a core only when the step thread leaves one idle: its nice value is
    the engine's plus LoaderSpec.niceness, and it still reads what the engine reads."""
    pool = make_pool(files["model"], processes=1)
    try:
        w = pool.read(str(files["paths"]["a"]), None)
        (child,) = pool.pids()
        assert os.getpriority(os.PRIO_PROCESS, child) == min(
            19, os.getpriority(os.PRIO_PROCESS, 0) + LoaderSpec("m", RANK, "float32").niceness)
        assert pool.spec.niceness > 0
        assert_same(w, load_lora(files["paths"]["a"], ModelConfig.from_dir(files["model"]),
                                 RANK))
    finally:
        pool.close()
