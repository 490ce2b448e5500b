"""Start-up warm-up (engine/warmup.py) covers every shape the scheduler can produce.

Graphs: every decode batch the limits allow (any size, adapters none / one / mixed,
greedy or not) maps to a key the warm-up captures. Kernels: on the CPU the engine's
kernel dispatch is routed to the Triton kernels, every launch is keyed as Triton keys its
compiled variants (tests/support/launch_keys.py; the kernels are not run, only their
launches followed: the values are garbage, the shapes real), and real traffic after the
warm-up (chunked prefills, decodes, mixed steps, adapters and base, long and short
contexts) must launch no variant the warm-up did not."""
import random

import pytest

from engine.cuda_graph import decode_buckets, graph_key
from engine.scheduler import ScheduledRequest
from engine.warmup import eager_shapes, graph_keys, token_counts, warm_up
from kernels import (attention_kernels_triton, elementwise_kernels_triton,
                     lora_kernels_triton, lora_mixed_kernels_triton,
                     lora_segment_kernels_triton, lora_token_kernels_triton,
                     norm_shrink_kernels_triton)
from tests.support.launch_keys import LaunchKeys, force_triton
from tests.test_engine_parity import prompts_of
from tests.test_lifecycle_tiers import greedy, make_engine

KERNEL_MODULES = (attention_kernels_triton, elementwise_kernels_triton, lora_kernels_triton,
                  lora_mixed_kernels_triton, lora_segment_kernels_triton,
                  lora_token_kernels_triton, norm_shrink_kernels_triton)
SMALL = dict(max_num_batched_tokens=16, max_num_seqs=3, max_model_len=40)
# past the kernels' thresholds: 16 sequences, 64 tokens, a split attention key range
LARGE = dict(max_num_batched_tokens=66, max_num_seqs=17, max_model_len=300)


@pytest.mark.parametrize("max_num_seqs", [1, 5, 64])
def test_every_decode_batch_has_a_captured_graph(max_num_seqs):
    keys = set(graph_keys(max_num_seqs))
    buckets = decode_buckets(max_num_seqs)
    rng = random.Random(max_num_seqs)
    for n in range(1, max_num_seqs + 1):
        for slots in ([-1] * n, [0] * n, [rng.randrange(-1, 4) for _ in range(n)],
                      [i % 3 for i in range(n)]):
            sched = [ScheduledRequest(None, 0, 1, (), s, True) for s in slots]
            for greedy_step in (False, True):
                assert graph_key(buckets, sched, greedy_step) in keys, (n, slots)
    assert len(keys) == 6 * len(buckets)


def test_token_counts_reach_the_limit():
    assert token_counts(16) == list(range(1, 17))
    counts = token_counts(8192)
    assert counts[-1] == 8192 and set(range(1, 65)) <= set(counts)
    assert {127, 128, 129, 255, 256, 257, 4096} <= set(counts)


def run_traffic(eng, limits: dict, seed: int) -> None:
    """Chunked prefills, decodes and mixed steps over adapters and the base model, with
    prompts from 1 token to nearly max_model_len, up to max_num_seqs at once."""
    rng = random.Random(seed)
    names = [None, "rs4", "ap8", "attn32"]
    top = limits["max_model_len"] - 7
    lengths = [1, 2, 5, 9, 15, 16, 17, 23, 31, top] + [rng.randrange(1, top) for _ in range(
        2 * limits["max_num_seqs"])]
    for i, p in enumerate(prompts_of(lengths, seed=seed)):
        eng.add_request(f"r{i}", p, greedy(rng.choice([1, 2, 6])), rng.choice(names))
        if rng.random() < 0.3:
            eng.step()
    for _ in range(2000):
        if not eng.has_unfinished():
            return
        eng.step()
    raise AssertionError("no progress")


def warmed_engine(llama_family, monkeypatch, limits: dict, shapes=None):
    force_triton(monkeypatch)
    blocks = limits["max_num_seqs"] * limits["max_model_len"] // 8 + 8
    eng = make_engine(llama_family, ["rs4", "ap8", "attn32"], max_loras=2, block_size=8,
                      num_kv_blocks=blocks, **limits)
    keys = LaunchKeys().install(monkeypatch, *KERNEL_MODULES, execute=False)
    if shapes is not None:
        monkeypatch.setattr("engine.warmup.eager_shapes", lambda *a: shapes)
    report = warm_up(eng.runner, eng.num_kv_blocks, 8, limits["max_num_seqs"],
                     limits["max_num_batched_tokens"], limits["max_model_len"])
    assert report.graphs == 0 and report.eager_steps > 0
    return eng, keys


@pytest.mark.parametrize("limits,norm_shrink", [(SMALL, "off"), (LARGE, "off"),
                                               (SMALL, "all")],
                         ids=["small", "large", "small-norm-shrink"])
def test_no_kernel_variant_is_compiled_after_warm_up(llama_family, monkeypatch, limits,
                                                     norm_shrink):
    """norm_shrink: engine/lora/batch.py FUSED_NORM_SHRINK (its kernel's variants too)."""
    from engine.lora import batch as batch_module
    monkeypatch.setattr(batch_module, "FUSED_NORM_SHRINK", norm_shrink)
    eng, keys = warmed_engine(llama_family, monkeypatch, limits)
    warm = set(keys.keys)
    run_traffic(eng, limits, seed=5)
    new = keys.keys - warm
    assert not new, f"{len(new)} kernel variants first launched after warm-up: {sorted(new)[:3]}"


def test_a_partial_warm_up_is_caught(llama_family, monkeypatch):
    """The check above can fail: warming up short steps only leaves variants for later."""
    short = [s for s in eager_shapes(SMALL["max_num_batched_tokens"], SMALL["max_num_seqs"],
                                     SMALL["max_model_len"], False)
             if s.num_tokens <= 2 and s.context == 0]
    eng, keys = warmed_engine(llama_family, monkeypatch, SMALL, shapes=short)
    warm = set(keys.keys)
    run_traffic(eng, SMALL, seed=5)
    assert keys.keys - warm


def test_engine_warm_up_is_a_no_op_on_the_cpu(llama_family):
    eng = make_engine(llama_family, [])
    assert eng.warm_up() is None
