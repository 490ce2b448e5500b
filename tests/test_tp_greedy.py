"""The greedy-pick decision under tensor parallelism: rank 0 decides, the step plan carries
the decision, and the worker acts on it (it cannot decide itself: it does not sample).

Both sides are real: rank 0's ModelRunner (the engine's Sampler) and a worker's
ModelRunner (worker.NoSampling) over the tiny Llama, PlanTracker -> wire format ->
RequestMirror between them, steps of real Requests. On the CPU there are no CUDA graphs,
so both runners take the eager path; what is checked is the decision, its transport, and
that each side consumes it (rank 0 samples every row, the worker returns nothing)."""
from __future__ import annotations

import pytest

from loramux_engine.distributed.mirror import RequestMirror
from loramux_engine.distributed.plan import decode_step, encode_step
from loramux_engine.distributed.tracker import PlanTracker
from loramux_engine.distributed.worker import NoSampling
from loramux_engine.lora import LoRASlotPool
from loramux_core.model.hf_config import ModelConfig
from loramux_engine.model.llama import LlamaForCausalLM
from loramux_engine.request import Request
from loramux_engine.runner import ModelRunner
from loramux_engine.sampling import SamplingState
from loramux_engine.scheduler import ScheduledRequest, SchedulerOutput
from loramux_core.sampling import SamplingParams

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def runners(llama_family):
    """(rank 0's runner, a worker's runner), each with its own model copy and KV cache."""
    cfg = ModelConfig.from_dir(llama_family.model_dir)
    out = []
    for sampler in (None, NoSampling()):
        model = LlamaForCausalLM(cfg)
        model.load_weights(llama_family.model_dir)
        pool = LoRASlotPool(cfg, 1, 8)
        out.append(ModelRunner(model, model.make_kv_caches(32, BS), pool, BS, "cpu",
                               sampler=sampler))
    return tuple(out)


def _request(rid: str, params: SamplingParams, n: int) -> Request:
    tokens = [3 + (5 * n + 7 * i) % 200 for i in range(n)]
    req = Request(rid, tokens, params)
    req.sampling_state = SamplingState.create(params, tokens, default_seed=0)
    return req


def _blocks(req: Request, base: int) -> tuple[int, ...]:
    return tuple(range(base, base + -(-req.num_tokens // BS)))


def _prefill(reqs):
    return SchedulerOutput([ScheduledRequest(r, 0, r.num_tokens, _blocks(r, 8 * i), -1, True)
                            for i, r in enumerate(reqs)])


def _decode(reqs):
    return SchedulerOutput([ScheduledRequest(r, r.num_tokens - 1, 1, _blocks(r, 8 * i), -1, True)
                            for i, r in enumerate(reqs)])


def _step(rank0, worker, tracker, mirror, out):
    """One step on both sides, as TPExecutor._launch and Worker._step do it."""
    greedy = rank0.takes_greedy_pick(out.scheduled, tensor_parallel=True)
    plan = decode_step(encode_step(tracker.plan(out, [], greedy)))
    mirrored = mirror.apply(plan)
    # the worker has no sampler to judge by: its own answer is always "no"
    assert worker.takes_greedy_pick(mirrored.scheduled, tensor_parallel=True) is False
    sampled = rank0.run(out, greedy)
    assert worker.run(mirrored, plan.greedy) == {}
    for s in out.scheduled:
        s.request.append_token(sampled[s.request.request_id].token_id)
    return plan


@pytest.mark.parametrize("odd", [
    None,
    SamplingParams(temperature=0.7, max_tokens=8),               # sampled, not greedy
    SamplingParams(temperature=0.0, max_tokens=8, top_logprobs=2),  # needs the full logits
    SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.2),
])
def test_plan_carries_rank0_greedy_decision_to_the_worker(runners, odd):
    rank0, worker = runners
    tracker, mirror = PlanTracker(), RequestMirror()
    reqs = [_request("a", GREEDY, 6), _request("b", GREEDY, 9)]
    if odd is not None:
        reqs.append(_request("c", odd, 5))
    plan = _step(rank0, worker, tracker, mirror, _prefill(reqs))
    assert plan.greedy is (odd is None)       # eager under TP: the pick when it serves all
    for _ in range(2):
        plan = _step(rank0, worker, tracker, mirror, _decode(reqs))
        assert plan.greedy is (odd is None)   # one row the pick cannot serve: no pick
    assert all(r.num_tokens == r.num_prompt_tokens + 3 for r in reqs)


def test_greedy_flag_round_trips_alone():
    """The flag is its own field of the wire format: it survives with nothing else set."""
    from loramux_engine.distributed.plan import StepPlan
    assert decode_step(encode_step(StepPlan(greedy=True))) == StepPlan(greedy=True)
    assert decode_step(encode_step(StepPlan())).greedy is False

