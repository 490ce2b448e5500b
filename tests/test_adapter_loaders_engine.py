"""Adapter loader processes inside an engine: greedy tokens equal Hugging Face + PEFT's
for adapters read (and read again after eviction) by the children into poisoned, reused
shared buffers, and with the in-process path selected; shared memory comes back to its
baseline when host copies go; the children end with the engine, also when it is killed."""
from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from loramux_engine import Engine, EngineConfig, SamplingParams
from loramux_engine.lora import load_lora
from loramux_core.model.hf_config import ModelConfig
from tests.test_engine_parity import (ADAPTERS, GREEDY, LENGTHS, MAX_NEW, assert_matches,
                                      make_engine, prompts_of)

pytestmark = pytest.mark.timeout(600)
MEMFD = "/memfd:loramux-host"


def shared_fds(pid: int | str = "self") -> int:
    """Descriptors of the process that name a shared host-buffer segment."""
    fds = f"/proc/{pid}/fd"
    out = 0
    for fd in os.listdir(fds):
        try:
            out += os.readlink(f"{fds}/{fd}").startswith(MEMFD)
        except OSError:  # closed meanwhile
            pass
    return out


def shared_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(MEMFD[1:] in line for line in f)


def poison_for(eng, family) -> None:
    """NaN-filled free buffers of every adapter's size, twice over."""
    mc = ModelConfig.from_dir(family.model_dir)
    sizes = [load_lora(p, mc, 64).buffer.nbytes for p in family.adapters.values()] * 2
    pool = eng.adapter_loaders.buffers
    bufs = [pool.acquire(n) for n in sizes]
    for b in bufs:
        b.data.view(torch.float32).fill_(float("nan"))
    for b in bufs:
        pool.release(b)


@pytest.mark.parametrize("loaders", [2, 0])
def test_tokens_match_peft_through_reads_into_poisoned_reused_buffers(
        llama_family, llama_oracle, loaders):
    """One slot and one host copy for three adapters: every switch reads an adapter
    again, into a buffer another adapter (or NaN) filled before."""
    with make_engine(llama_family, max_loras=1, max_cpu_loras=1,
                     adapter_loaders=loaders) as eng:
        if loaders:
            poison_for(eng, llama_family)
        prompts = prompts_of(LENGTHS, seed=5)
        refs = llama_oracle.generate(prompts, ADAPTERS, MAX_NEW)
        assert_matches(eng.generate(prompts, GREEDY, ADAPTERS), refs)
        stats = eng.stats()["adapters"].values()
        assert sum(a["disk_reads"] for a in stats) >= 2  # read back after eviction
        if loaders:
            assert eng.adapter_loaders.pids() and eng.adapter_loaders.broken is None
            assert eng.adapter_loaders.buffers.shared
        else:
            assert eng.adapter_loaders is None


def test_shared_memory_comes_back_when_host_copies_go(llama_family, tmp_path, monkeypatch):
    """One segment (two descriptors) per buffer here, so descriptors count buffers:
    loads and evictions of
    many adapters hold at most the host tier's buffers (plus spares); the children keep
    no mapping between reads; closing the engine gives every segment back."""
    import loramux_engine.lora.shared_memory as shm
    monkeypatch.setattr(shm, "SEGMENT_BUFFERS", 1)
    gc.collect()  # the segments of engines before this one
    base = shared_fds()
    names = list(llama_family.adapters)
    paths = {}
    for i in range(12):
        paths[f"n{i}"] = shutil.copytree(llama_family.adapters[names[i % 3]], tmp_path / f"n{i}")
    eng = make_engine(llama_family, max_loras=1, max_cpu_loras=2)
    try:
        for i, (name, path) in enumerate(paths.items()):
            eng.add_adapter(name, path)
            eng.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2),
                         [f"n{max(i - 3, 0)}"])  # an evicted one: read back
            if i >= 4:
                eng.remove_adapter(f"n{i - 4}")
        gc.collect()
        pool = eng.adapter_loaders.buffers
        pool.wait_spares()  # a spare being made holds its segment before it is counted
        held = shared_fds() - base
        assert 0 < held <= 2 * (pool.num_allocations + pool.num_spares_made)
        assert pool.num_allocations + pool.num_spares_made <= 3 * (2 + 1 + 1)  # 3 sizes
        for pid in eng.adapter_loaders.pids():
            assert shared_maps(pid) == 0 and shared_fds(pid) == 0
    finally:
        eng.close()
    del eng, pool
    gc.collect()
    assert shared_fds() == base


_KILLED = """
import json, sys, threading
from loramux_engine import Engine, EngineConfig
eng = Engine(EngineConfig(model=sys.argv[1], device="cpu", dtype="float32", max_loras=2,
                          max_lora_rank=64, num_kv_blocks=64, adapter_loaders=2))
reads = [threading.Thread(target=eng.adapter_loaders.read, args=(p, None))
         for p in sys.argv[2:]]
for t in reads: t.start()
for t in reads: t.join()
print(json.dumps(eng.adapter_loaders.pids()), flush=True)
sys.stdin.read()
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


def test_no_loader_outlives_its_engine(llama_family):
    paths = [str(p) for p in llama_family.adapters.values()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    engine = subprocess.Popen([sys.executable, "-c", _KILLED, str(llama_family.model_dir),
                               *paths], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=env, text=True)
    try:
        pids = json.loads(engine.stdout.readline())
        assert pids and not any(_gone(p) for p in pids)
    finally:
        engine.kill()
        engine.wait()
    deadline = time.monotonic() + 120
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)  # until they are gone (a condition, not a delay)
    assert all(_gone(p) for p in pids), pids


def test_closing_the_engine_stops_its_loaders(llama_family):
    eng = make_engine(llama_family)
    pids = eng.adapter_loaders.pids()
    assert pids
    eng.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert eng.adapter_loaders.pids() == []
    with pytest.raises(Exception):
        eng.adapter_loaders.read(str(llama_family.adapters["rs4"]), None)


def test_a_loader_killed_during_a_first_use_read_fails_only_that_adapter(llama_family):
    """One host copy for three adapters: a request for an evicted one reads it back; the
    loader doing that read is killed. That request ends with the reason, the base
    request beside it runs to the end, and the next read gets a fresh loader."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with make_engine(llama_family, max_loras=1, max_cpu_loras=1) as eng:
        pool = eng.adapter_loaders
        (victim,) = pool.pids()   # the adds read one at a time: one child so far
        assert eng.stats()["adapters"][eng.registry.resolve("rs4")]["state"] == "disk"
        os.kill(victim, signal.SIGSTOP)
        eng.add_request("r-rs4", [5, 6, 7], params, adapter="rs4")
        eng.add_request("r-base", [5, 6, 7], params)
        outs = {}
        while pool.num_idle:   # until the read holds the stopped child
            outs.update((o.request_id, o) for o in eng.step())
        os.kill(victim, signal.SIGKILL)
        while "r-rs4" not in outs or "r-base" not in outs or not outs["r-base"].finished:
            for o in eng.step():
                if o.finished or o.request_id not in outs:
                    outs[o.request_id] = o
        err = outs["r-rs4"].error
        assert "adapter 'rs4' cannot be served" in str(err) and "loader process died" in str(err)
        assert outs["r-base"].finish_reason == "length"
        eng.add_adapter("rs4-again", llama_family.adapters["rs4"])
        again = eng.generate([[5, 6, 7]], params, ["rs4-again"])[0]
        assert len(again.token_ids) == 6 and victim not in pool.pids()
        assert pool.num_replaced == 1
