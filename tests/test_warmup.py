"""Start-up warm-up (engine/warmup.py) covers every shape the scheduler can produce.

Graphs: every decode batch the limits allow (any size, adapters none / one / mixed with
many or few rows per adapter, greedy or not) maps to a key the warm-up captures, and the
warm-up captures no key that no batch reaches. Kernels: on the CPU the engine's
kernel dispatch is routed to the Triton kernels, every launch is keyed as Triton keys its
compiled variants (tests/support/launch_keys.py; the kernels are not run, only their
launches followed: the values are garbage, the shapes real), and real traffic after the
warm-up (chunked prefills, decodes, mixed steps, adapters and base, long and short
contexts) must launch no variant the warm-up did not, nor run the LoRA kernels of a token
count on a path (spread over adapters or not) that the warm-up did not: with the tiny
test model both paths' kernels can share their Triton variants, so the path is followed
apart. Adapters with extras (DoRA, LoRA on lm_head and embed_tokens) in that traffic
launch nothing new either, and their graph keys are captured."""
import random

import pytest

from loramux_engine.cuda_graph import decode_buckets, graph_key
from loramux_engine.lora.batch import spread_over_adapters
from loramux_engine.lora.pool import LoRAExtras
from loramux_engine.scheduler import ScheduledRequest
from loramux_engine.warmup import (CoveringShapes, chosen_shapes, eager_shapes, graph_keys,
                           token_counts, warm_up)
from loramux_kernels import attention_kernels_triton, elementwise_kernels_triton
from loramux_kernels.lora import (launch, mixed_kernels, norm_shrink, segment, silu_shrink,
                                  slot_rows, token)
from tests.support.launch_keys import LaunchKeys, force_triton
from tests.conftest import TEST_DEVICE
from tests.conftest import ADAPTER_SPECS, TinyFamily
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model
from tests.test_engine_parity import prompts_of
from tests.test_lifecycle_tiers import greedy, make_engine

KERNEL_MODULES = (attention_kernels_triton, elementwise_kernels_triton, token, mixed_kernels,
                  segment, norm_shrink, silu_shrink, slot_rows)
SMALL = dict(max_num_batched_tokens=16, max_num_seqs=3, max_model_len=40)
# past the kernels' thresholds: 16 sequences, 64 tokens, a split attention key range
LARGE = dict(max_num_batched_tokens=66, max_num_seqs=17, max_model_len=300)


def batches(n: int, rng: random.Random):
    """Slot lists of n decode rows: base, one adapter, random, round robin over 3, one
    adapter per row, a base row among one adapter's, one adapter row among base rows, and
    4 and 3-4 rows per adapter (either side of the H100's rule)."""
    yield from ([-1] * n, [0] * n, [rng.randrange(-1, 4) for _ in range(n)],
                [i % 3 for i in range(n)], list(range(n)), [0] * (n - 1) + [-1],
                [0] + [-1] * (n - 1), [i % max(1, n // 4) for i in range(n)],
                [i % (n // 4 + 1) for i in range(n)])


# rows per adapter the LoRA kernels need by bucket: none, the CPU's (the interpreter's
# table: the segment kernels above 64 tokens) and a rule of 2 everywhere
RULES = {"none": lambda b: 0, "cpu": lambda b: launch.mixed_min_rows("cpu", b),
         "two": lambda b: 2}


# the extras the slot pool has buffers for (LoRASlotPool.extras_allocated)
EXTRAS = {"none": LoRAExtras(), "dora": LoRAExtras(dora=True),
          "all": LoRAExtras(True, True, True)}


def extras_of(slots, allocated: LoRAExtras) -> LoRAExtras:
    """The pool's answer when slot s holds the extras of the bits of s % 8 (of those
    allocated): 0 none, 1 DoRA, 2 lm_head, 4 embed_tokens, 7 all three."""
    bits = 0
    for s in slots:
        bits |= s % 8 if s >= 0 else 0
    return LoRAExtras(*(bool(bits & 1 << i) and on for i, on in enumerate(allocated)))


@pytest.mark.parametrize("extras", EXTRAS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("max_num_seqs", [1, 5, 64, 130])
def test_every_decode_batch_has_a_captured_graph(max_num_seqs, rule, extras):
    """Every batch's key is captured (both spread bits where the rule has them, every
    combination of the allocated extras: each batch's slots s -> 8 s + k, k = 0..7) and
    every captured key is some batch's."""
    buckets = decode_buckets(max_num_seqs)
    min_rows = {b: RULES[rule](b) for b in buckets}
    allocated = EXTRAS[extras]
    keys = set(graph_keys(max_num_seqs, min_rows, allocated))
    rng = random.Random(max_num_seqs)
    reached = set()
    for n in range(1, max_num_seqs + 1):
        for base_slots in batches(n, rng):
            for k in range(8) if any(allocated) else (0,):
                slots = [8 * s + k if s >= 0 else s for s in base_slots]
                sched = [ScheduledRequest(None, 0, 1, (), s, True) for s in slots]
                for greedy_step in (False, True):
                    key = graph_key(buckets, sched, greedy_step, min_rows,
                                    extras_of(slots, allocated))
                    assert key in keys, (n, slots)
                    reached.add(key)
    assert reached == keys
    plain = graph_keys(max_num_seqs, min_rows)   # each LoRA key once per subset of extras
    assert len(keys) == len(plain) + sum(k.lora for k in plain) * (2 ** sum(allocated) - 1)
    spread = {k.bucket for k in keys if k.spread}
    if rule == "cpu" and max_num_seqs > 64:
        assert spread == {128, 130}
    assert spread == ({b for b in buckets if b >= 2 and min_rows[b] >= 2})


def test_graph_key_follows_the_rows_per_adapter_rule():
    """At 4 rows per adapter (the CPU's rule at 128 rows) a mixed batch keeps the segment
    kernels' graph; one adapter more (3.8 rows each) takes the spread graph; rows of the
    base model are not counted; one adapter or none is never spread."""
    buckets = decode_buckets(128)
    min_rows = {b: launch.mixed_min_rows("cpu", b) for b in buckets}
    assert min_rows[128] == 4 and min_rows[64] == 0

    def key(slots):
        return graph_key(buckets, [ScheduledRequest(None, 0, 1, (), s, True) for s in slots],
                         True, min_rows)
    four = key([i % 24 for i in range(96)])
    fewer = key([i % 25 for i in range(96)])
    assert four[:4] == fewer[:4] == (128, True, True, False)
    assert (four.spread, fewer.spread) == (False, True) and four != fewer
    assert key([i % 24 for i in range(96)] + [-1] * 30) == four
    assert key([i % 25 for i in range(96)] + [-1] * 30) == fewer
    assert not key([3] * 100).spread and not key([3] + [-1] * 99).uniform
    assert key([3] + [-1] * 99).spread and not key([-1] * 100).spread
    assert key([i % 25 for i in range(60)])[:5] == (64, True, True, False, False)  # 0: no rule


def test_spread_rule_at_the_boundary():
    for adapters in (1, 2, 7, 64):
        rows = 4 * adapters
        at = [(i % adapters, 1) for i in range(rows)]
        assert not spread_over_adapters(at, 4)
        assert spread_over_adapters(at[:-1] + [(-1, 1)] * 5, 4)
        assert not spread_over_adapters([(i, 4) for i in range(adapters)], 4)
        assert spread_over_adapters([(i, 4) for i in range(adapters)] + [(adapters, 3)], 4)
        assert not spread_over_adapters(at[:-1], 0)


def test_token_counts_reach_the_limit():
    assert token_counts(16) == list(range(1, 17))
    counts = token_counts(8192)
    assert counts[-1] == 8192 and set(range(1, 65)) <= set(counts)
    assert {127, 128, 129, 255, 256, 257, 4096} <= set(counts)


def run_traffic(eng, limits: dict, seed: int,
                names=(None, "rs4", "ap8", "attn32")) -> None:
    """Chunked prefills, decodes and mixed steps over adapters (`names`) and the base
    model, with prompts from 1 token to nearly max_model_len, up to max_num_seqs at once."""
    rng = random.Random(seed)
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


class LoRAPaths:
    """`paths`: (tokens, spread) of every eager step with adapters the runner ran."""

    def __init__(self, runner, monkeypatch):
        self.paths: set[tuple[int, bool]] = set()
        forward = runner._forward

        def recorded(inputs):
            if inputs.has_lora:
                self.paths.add((inputs.input_ids.shape[0], inputs.lora_spread))
            return forward(inputs)
        monkeypatch.setattr(runner, "_forward", recorded)


def warmed_engine(llama_family, monkeypatch, limits: dict, shapes=None, more=None,
                  only=None, covering=None, **config):
    """`more`: {name: path} of further adapters, read before the warm-up; `only`: the
    warm-up's eager shapes; `covering`: a CoveringShapes told the shapes that launched a
    new variant; `config`: more EngineConfig fields."""
    force_triton(monkeypatch)
    blocks = limits["max_num_seqs"] * limits["max_model_len"] // 8 + 8
    eng = make_engine(llama_family, ["rs4", "ap8", "attn32"], max_loras=2, block_size=8,
                      num_kv_blocks=blocks, **limits, **config)
    for name, path in (more or {}).items():
        eng.add_adapter(name, path)
    keys = LaunchKeys().install(monkeypatch, *KERNEL_MODULES, execute=False)
    keys.lora_paths = LoRAPaths(eng.runner, monkeypatch)
    if shapes is not None:
        monkeypatch.setattr("loramux_engine.warmup.eager_shapes", lambda *a, **kw: shapes)
    seen = [0]

    def at(shape):   # keys launched since the last shape began were that shape's
        if covering is not None:
            if len(keys.keys) > seen[0]:
                covering.found()
            seen[0] = len(keys.keys)
            covering.at(shape)
    report = warm_up(eng.runner, eng.num_kv_blocks, 8, limits["max_num_seqs"],
                     limits["max_num_batched_tokens"], limits["max_model_len"], only=only,
                     on_shape=at)
    assert report.graphs == 0 and report.eager_steps > 0
    eng.warm_up_report = report
    return eng, keys


# The launch-key checks follow the CPU engine routed to the Triton kernels without running
# them (no graphs: every decode step is an eager shape); on CUDA the warm-up captures graphs
# instead, which tests/test_cuda_graphs.py covers.
cpu_model = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU warm-up model "
                               "(launches followed, not run); CUDA: tests/test_cuda_graphs.py")


@cpu_model
@pytest.mark.parametrize("limits,norm_shrink", [(SMALL, ("off", "off")), (LARGE, None),
                                               (SMALL, ("all", "all")), (SMALL, None)],
                         ids=["small", "large-defaults", "small-norm-shrink", "small-defaults"])
def test_no_kernel_variant_is_compiled_after_warm_up(llama_family, monkeypatch, limits,
                                                     norm_shrink):
    """norm_shrink: engine/lora/batch.py (FUSED_NORM_SHRINK, FUSED_SILU_SHRINK), their
    kernels' variants too; None: as the engine ships."""
    from loramux_engine.lora import batch as batch_module
    if norm_shrink is not None:
        monkeypatch.setattr(batch_module, "FUSED_NORM_SHRINK", norm_shrink[0])
        monkeypatch.setattr(batch_module, "FUSED_SILU_SHRINK", norm_shrink[1])
    eng, keys = warmed_engine(llama_family, monkeypatch, limits)
    warm, warm_paths = set(keys.keys), set(keys.lora_paths.paths)
    run_traffic(eng, limits, seed=5)
    new = keys.keys - warm
    assert not new, f"{len(new)} kernel variants first launched after warm-up: {sorted(new)[:3]}"
    new_paths = keys.lora_paths.paths - warm_paths
    assert not new_paths, f"LoRA (tokens, spread) first run after warm-up: {sorted(new_paths)}"
    if limits is LARGE:   # past 64 tokens the CPU's table has both paths; traffic reaches them
        assert {(66, False), (66, True)} <= keys.lora_paths.paths


@pytest.fixture(scope="module")
def extras_adapters(llama_family, tmp_path_factory) -> dict:
    """A DoRA adapter and one with LoRA on lm_head and embed_tokens."""
    root, model = tmp_path_factory.mktemp("warmup_extras"), llama_family.model_dir
    return {"dora": make_adapter(root / "dora", model, AdapterSpec(r=8, seed=81),
                                 use_dora=True),
            "ends": make_adapter(root / "ends", model, AdapterSpec(
                r=8, seed=82, target_modules=("q_proj", "lm_head", "embed_tokens")))}


@cpu_model
@pytest.mark.parametrize("buffers", ["configured", "read"])
def test_adapters_with_extras_compile_nothing_after_warm_up(llama_family, monkeypatch,
                                                           extras_adapters, buffers):
    """With the pool's buffers for DoRA and lm_head / embed_tokens LoRA taken at start
    (EngineConfig.lora_extras; the adapters read after the warm-up) or at the read of a
    DoRA adapter and an lm_head / embed_tokens one before it, traffic mixing those
    adapters with plain ones and the base model launches no variant the warm-up did not,
    DoRA's and the ends' kernels included; the warm-up leaves no slot marked as holding
    them."""
    if buffers == "configured":
        eng, keys = warmed_engine(llama_family, monkeypatch, SMALL,
                                  lora_extras=("dora", "lm_head", "embed_tokens"))
    else:
        eng, keys = warmed_engine(llama_family, monkeypatch, SMALL, more=extras_adapters)
    pool = eng.runner.lora_pool
    assert pool.extras_allocated == LoRAExtras(True, True, True)
    assert not pool.dora_slots and not pool.end_slots
    if buffers == "configured":
        for name, path in extras_adapters.items():
            eng.add_adapter(name, path)
    warm = set(keys.keys)
    keys.keys.clear()
    run_traffic(eng, SMALL, seed=5, names=(None, "rs4", "dora", "ends"))
    new = keys.keys - warm
    assert not new, f"{len(new)} kernel variants first launched after warm-up: {sorted(new)[:3]}"
    launched = {key[0] for key in keys.keys}
    assert {"scale_rows_kernel", "gather_a_columns_kernel"} <= launched, launched


@cpu_model
@pytest.mark.parametrize("limits,window", [(SMALL, 7), (LARGE, 280)], ids=["small", "large"])
def test_a_sliding_window_compiles_nothing_after_warm_up(monkeypatch, tmp_path_factory,
                                                         limits, window):
    """A Mistral model with a sliding window: the attention's window variant (and its key
    splits, sized to the window: 280 splits a decode over 300 keys as one over 287 would)
    is launched by the warm-up, and traffic past the window launches nothing new."""
    root = tmp_path_factory.mktemp(f"warmup_window{window}")
    model = make_model(root / "model", TinySpec(arch="mistral", sliding_window=window, seed=22))
    family = TinyFamily("mistral_window", model, {
        name: make_adapter(root / name, model, spec) for name, spec in ADAPTER_SPECS.items()})
    eng, keys = warmed_engine(family, monkeypatch, limits)
    warm = set(keys.keys)
    assert any(("WINDOW", window) in key for name, key in warm if name == "paged_attn_kernel")
    run_traffic(eng, limits, seed=5)
    new = keys.keys - warm
    assert not new, f"{len(new)} kernel variants first launched after warm-up: {sorted(new)[:3]}"


@cpu_model
def test_the_covering_shapes_alone_leave_nothing_for_traffic(llama_family, monkeypatch):
    """A warm-up of only the eager shapes that first launched some variant in a full one
    (what a parallel compile keeps with its cache mark) launches every variant the full
    one did, and traffic after it launches none new."""
    covering = CoveringShapes()
    full, full_keys = warmed_engine(llama_family, monkeypatch, LARGE, covering=covering)
    assert 0 < len(covering.shapes) < full.warm_up_report.eager_steps
    monkeypatch.undo()
    eng, keys = warmed_engine(llama_family, monkeypatch, LARGE, only=covering.shapes)
    assert eng.warm_up_report.eager_steps <= len(covering.shapes) + 1
    assert keys.keys == full_keys.keys
    warm = set(keys.keys)
    run_traffic(eng, LARGE, seed=5)
    new = keys.keys - warm
    assert not new, f"{len(new)} kernel variants first launched after warm-up: {sorted(new)[:3]}"


def test_chosen_shapes_keep_the_largest_step():
    shapes = eager_shapes(66, 17, 300, False, lambda t: 0)
    largest = max(shapes, key=lambda s: (s.num_tokens, s.context))
    assert chosen_shapes(shapes, None) == shapes
    assert chosen_shapes(shapes, [shapes[3]]) == [shapes[3], largest]
    assert chosen_shapes(shapes, []) == [largest]


@cpu_model
def test_a_partial_warm_up_is_caught(llama_family, monkeypatch):
    """The check above can fail: warming up short steps only leaves variants for later
    (at the large limits: with no kernel keyed by a step's token count, the short steps
    of the small ones launch every variant their traffic does)."""
    short = [s for s in eager_shapes(LARGE["max_num_batched_tokens"], LARGE["max_num_seqs"],
                                     LARGE["max_model_len"], False, lambda t: 0)
             if s.num_tokens <= 2 and s.context == 0]
    eng, keys = warmed_engine(llama_family, monkeypatch, LARGE, shapes=short)
    warm = set(keys.keys)
    run_traffic(eng, LARGE, seed=5)
    missed = {name for name, _ in keys.keys - warm}
    assert {"paged_attn_kernel", "lora_shrink_tok_kernel"} <= missed, missed


@pytest.mark.engine_device("cpu")
def test_engine_warm_up_is_a_no_op_on_the_cpu(llama_family):
    eng = make_engine(llama_family, [])
    assert eng.warm_up() is None
