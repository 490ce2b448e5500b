"""The start-up warm-up under tensor parallelism (two gloo ranks on the CPU, the warm-up
forced there): every rank runs the same eager steps in step (their all-reduces pair up,
and rank 0 checks that each worker ran as many), and the engine then serves token for
token as one rank does, also after a dry run on rank 0 alone (the parallel compile's
listing: its collectives skipped, TPGroup.without_peers, the workers idle). A worker
whose warm-up fails makes the engine dead instead of leaving rank 0 in a collective, and
a rank 0 whose warm-up fails stops the workers. A warm-up plan survives its trip to the
workers."""
from __future__ import annotations

import pytest

import torch

from loramux_engine import Engine, EngineConfig
from loramux_engine.parallel import TPGroup
from loramux_engine.distributed.plan import decode_text, encode_text
from loramux_engine.cuda_graph import GraphKey
from loramux_engine.warmup import EagerShape, WarmupPlan
from tests.test_tp_engine import CFG, GREEDY, MIXED, PROMPTS, assert_same, run_all


def test_a_warm_up_plan_round_trips():
    shapes = (EagerShape(5, 2, 40, True), EagerShape(1, 1, 0, False, True))
    keys = (GraphKey(8, False, True), GraphKey(16, True, False, True, False, True, False, True))
    for plan in (WarmupPlan(20, 4, (0, 1), shapes), WarmupPlan(20, 4, (0, 3, 5), shapes, keys)):
        back = WarmupPlan.from_json(decode_text(encode_text(plan.to_json())))
        assert back == plan and all(type(k) is GraphKey for k in back.keys)


def test_without_peers_a_group_skips_its_collectives():
    tp = TPGroup(0, 2, group=None)
    t = torch.randn(3, 4)
    with pytest.raises((RuntimeError, ValueError)):   # no process group: it would talk
        tp.all_reduce(t.clone())
    other = TPGroup(1, 2, group=None)
    with tp.without_peers():
        with tp.without_peers():   # nests
            pass
        with pytest.raises((RuntimeError, ValueError)):   # another group still talks
            other.all_reduce(t.clone())
        kept = t.clone()
        assert tp.all_reduce(kept) is kept and torch.equal(kept, t)
        assert tp.broadcast(kept) is kept and torch.equal(kept, t)
        assert torch.equal(tp.all_gather(t, dim=-1), torch.cat([t, t], dim=-1))
    with pytest.raises((RuntimeError, ValueError)):
        tp.broadcast(t.clone())


def test_every_rank_warms_up_and_serves_as_one_rank_does(llama_family):
    reqs = [(f"mixed-{i}", p, a) for i, (p, a) in enumerate(zip(PROMPTS, MIXED))]
    outputs, reports = {}, {}
    for tp in (1, 2):
        with Engine(EngineConfig(model=str(llama_family.model_dir), tp_size=tp, **CFG)) as eng:
            for name, path in llama_family.adapters.items():
                eng.add_adapter(name, path)
            if tp == 2:   # the parallel compile's dry run: rank 0 alone, workers idle
                alone = eng.warm_up(force=True, this_rank=True)
            reports[tp] = eng.warm_up(force=True)
            outputs[tp] = run_all(eng, reqs)["outputs"]
            assert not eng.executor.dead
    assert reports[2].eager_steps == reports[1].eager_steps == alone.eager_steps > 20
    assert_same(outputs[1], outputs[2])
    assert all(len(t) == GREEDY.max_tokens for t, _ in outputs[2].values())


@pytest.mark.engine_device("cpu")
def test_a_worker_that_fails_its_warm_up_is_engine_dead(llama_family):
    """A worker whose warm-up fails (here: a plan it cannot read) ends; rank 0, waiting
    in the warm-up's first all-reduce, is told as EngineDeadError, and no rank hangs."""
    from loramux_engine.distributed.executor import TPExecutor
    from loramux_core.errors import EngineDeadError

    with Engine(EngineConfig(model=str(llama_family.model_dir), tp_size=2, **CFG)) as eng:
        assert isinstance(eng.executor, TPExecutor)
        plan = WarmupPlan.of(eng.runner, eng.num_kv_blocks, 4, 8, 16, eng.max_model_len,
                             only=(EagerShape(1, 1, 0, False),))

        class Unreadable:   # the workers are sent broken JSON, rank 0 runs `plan`
            def to_json(self):
                return "{"

            def run(self, *args):
                return plan.run(*args)

        with pytest.raises(EngineDeadError, match="rank 1"):
            eng.executor.warm_up(eng.runner, Unreadable())
        assert eng.executor.dead


@pytest.mark.engine_device("cpu")
def test_a_rank_0_that_fails_its_warm_up_stops_the_workers(llama_family):
    """Rank 0's warm-up raising while the worker is in its first eager step's all-reduce:
    EngineDeadError naming rank 0's error, and the worker is stopped, not left waiting."""
    from loramux_engine.distributed.executor import TPExecutor
    from loramux_core.errors import EngineDeadError

    with Engine(EngineConfig(model=str(llama_family.model_dir), tp_size=2, **CFG)) as eng:
        assert isinstance(eng.executor, TPExecutor)
        plan = WarmupPlan.of(eng.runner, eng.num_kv_blocks, 4, 8, 16, eng.max_model_len)

        class Failing:   # the workers are sent `plan`, rank 0 fails before its first step
            def to_json(self):
                return plan.to_json()

            def run(self, *args):
                raise ValueError("no kernel for this shape")

        with pytest.raises(EngineDeadError, match="failed on rank 0.*no kernel"):
            eng.executor.warm_up(eng.runner, Failing())
        assert eng.executor.dead
        assert not any(p.is_alive() for p in eng.executor._procs)
