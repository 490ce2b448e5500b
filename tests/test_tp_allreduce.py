"""Which all-reduce a tensor-parallel group uses (engine/distributed/fast_allreduce.py),
on the CPU: EngineConfig.tp_allreduce validation, the selection (gloo never picks
symmetric memory), and the set-up's agreement over a real two-rank gloo control group
(every rank learns that one rank failed, and why where it is that rank). The one-shot
kernel itself needs CUDA: benchmarks/bench_tp.py's `allreduce` phase checks it."""
from __future__ import annotations

import pytest
import torch

from loramux_engine import EngineConfig
from loramux_engine.distributed import fast_allreduce as fa
from loramux_engine.distributed import group as pg
from loramux_engine.parallel import TPGroup
from loramux_core.errors import InvalidRequestError
from tests.support.ranks import two_ranks


def test_config_refuses_unknown_mode_precisely():
    with pytest.raises(InvalidRequestError, match=r"tp_allreduce='fast': must be one of "
                                                  r"\['auto', 'nccl', 'symm_mem'\]"):
        EngineConfig(model="m", tp_allreduce="fast")


def test_config_refuses_symm_mem_off_cuda_and_beyond_eight_ranks():
    with pytest.raises(InvalidRequestError, match=r"tp_allreduce='symm_mem' needs "
                                                  r"device='cuda' \(device='cpu'\)"):
        EngineConfig(model="m", device="cpu", tp_size=2, tp_allreduce="symm_mem")
    with pytest.raises(InvalidRequestError, match=r"tp_size <= 8 \(tp_size=16\)"):
        EngineConfig(model="m", device="cuda", tp_size=16, tp_allreduce="symm_mem")
    assert EngineConfig(model="m").tp_allreduce == "auto"
    assert EngineConfig(model="m", device="cuda", tp_size=2, tp_allreduce="symm_mem")


@pytest.mark.parametrize("mode", ["auto", "nccl"])
@pytest.mark.parametrize("size", [1, 2, 4, 16])
def test_cpu_never_picks_symmetric_memory(mode, size):
    assert fa.choose(mode, "cpu", size) == ("none" if size == 1 else "gloo")


def test_cuda_choice_by_mode_and_size():
    assert fa.choose("auto", "cuda", 2) == "symm_mem"
    assert fa.choose("auto", "cuda", 8) == "symm_mem"
    assert fa.choose("auto", "cuda", 16) == "nccl"   # beyond the kernel: NCCL, no error
    assert fa.choose("nccl", "cuda", 2) == "nccl"
    assert fa.choose("symm_mem", "cuda", 4) == "symm_mem"
    assert fa.choose("auto", "cuda", 1) == "none"
    with pytest.raises(InvalidRequestError, match="needs device='cuda'"):
        fa.choose("symm_mem", "cpu", 2)
    with pytest.raises(InvalidRequestError, match="must be one of"):
        fa.choose("one-shot", "cuda", 2)


def test_attach_leaves_a_cpu_group_alone(llama_family):
    tp = TPGroup(0, 2, object())
    config = EngineConfig(model=str(llama_family.model_dir), tp_size=2)
    assert fa.attach(tp, None, config, torch.device("cpu")) is tp  # no collective either




def test_every_rank_learns_that_one_rank_failed():
    def fn(rank, groups):
        mine = "no buffer here" if rank == 1 else ""
        return fa._agree(groups.tp, groups.control, mine, "allocate")
    assert two_ranks(fn) == {0: "rank 1 could not allocate", 1: "no buffer here"}


def test_agreement_is_empty_when_all_succeed():
    assert two_ranks(lambda r, g: fa._agree(g.tp, g.control, "", "x")) == {0: "", 1: ""}


def test_setup_off_cuda_gives_no_reducer_on_any_rank():
    def fn(rank, groups):
        return fa.OneShotAllReduce.create(groups.tp, groups.control, 64 * 128,
                                          torch.bfloat16, torch.device("cpu"))
    assert two_ranks(fn) == {0: (None, "not a CUDA device"), 1: (None, "not a CUDA device")}


def test_self_test_compares_with_the_group_sum():
    """The set-up's self-test check over a real gloo group: a correct sum passes, a step
    that leaves the values alone is caught, and the test values differ per rank."""
    def fn(rank, groups):
        setup = fa._SetUp(fa.OneShotAllReduce, groups.tp, 64, torch.float32,
                          torch.device("cpu"))
        good = setup._values(0)
        ok = setup._check(good, lambda: torch.distributed.all_reduce(good, group=groups.tp.group))
        bad = setup._check(setup._values(1), lambda: None)
        return ok, bad, setup._values(0)[:4].tolist()
    out = two_ranks(fn)
    assert out[0][0] == out[1][0] == ""
    assert out[0][1].endswith("of 64 sums differ from NCCL's") and out[1][1] == out[0][1]
    assert out[0][2] != out[1][2]


def test_a_later_engine_of_the_process_skips_the_rendezvous(monkeypatch):
    """Once this process entered a symmetric-memory rendezvous, a later engine's set-up
    stops at the local checks on every rank (NCCL, with the reason) instead of waiting out
    a rendezvous that its new workers, whose key sequence starts at zero, cannot answer."""
    monkeypatch.setattr(fa, "_rendezvous_entered", True)

    def fn(rank, groups):
        return fa.OneShotAllReduce.create(groups.tp, groups.control, 64 * 128,
                                          torch.bfloat16, torch.device("cuda"))
    out = two_ranks(fn)
    assert out[0] == out[1]
    assert out[0][0] is None
    assert "set up by an earlier engine of this process" in out[0][1]


def test_a_second_cuda_tp_engine_is_refused_before_any_worker_starts(monkeypatch, llama_family):
    """While a CUDA TP engine of this process holds torch.distributed's default group, a
    new one is refused with a precise error before it spawns a worker or opens a store;
    the CPU (free-standing gloo groups) is not concerned."""
    import multiprocessing

    from loramux_engine.distributed.executor import TPExecutor
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    pg.check_free(torch.device("cpu"))
    before = {p.pid for p in multiprocessing.active_children()}
    cfg = EngineConfig(model=str(llama_family.model_dir), device="cuda", tp_size=2)
    with pytest.raises(InvalidRequestError, match="already running in this process"):
        TPExecutor(cfg)
    assert {p.pid for p in multiprocessing.active_children()} == before
