"""Start-up warm-up: compile every kernel variant and capture every CUDA graph the
configured limits can reach, before the engine serves, so that the first request after
"serving" runs like the millionth (no Triton compile, no graph capture mid-traffic).

What a step can look like is bounded by the config:
- A decode step of n <= max_num_seqs sequences replays the graph of its bucket, keyed
  (bucket, lora, greedy, uniform, spread, dora, head, embed) (engine/cuda_graph.py
  GraphKey): `graph_keys` lists every key some batch can reach and every one is
  captured. The extras bits (rows on DoRA adapters, adapters with lm_head /
  embed_tokens LoRA) are reachable only for the extras the slot pool has buffers for
  (LoRASlotPool.extras_allocated: made at start for EngineConfig.lora_extras, else at
  the first read of an adapter that needs them), and then in every combination (one adapter may have all three), so each LoRA
  key is captured once per subset of them: x2 for DoRA alone, x8 for all three (56 ->
  94 -> 322 graphs at max_num_seqs=256). An extra whose buffers come only after the
  warm-up is captured (and its kernels compiled) when a step first needs it. A greedy
  graph's pick (engine/cuda_graph.py GREEDY_PICK "triton": kernels/greedy_pick_triton.py)
  has one compiled variant per vocabulary and dtype, whatever the bucket: the first
  greedy capture compiles it.
- Any other step (prefill, mixed, decode with CUDA graphs off) runs eagerly over
  T <= max_num_batched_tokens tokens of s <= max_num_seqs sequences, with or without
  adapters. A kernel variant is a function of (T, s, context length) through the
  kernels' launch heuristics (thresholds at 16, 32, 64, 256, ... tokens) and Triton's
  integer specialisation (a value of 1, a multiple of 16): `eager_shapes` visits every
  token count up to 64, then every power of two and its neighbours and every multiple of
  16 next to them up to the limit, as decode-only, one-prefill and mixed steps, with
  short and long contexts; and where the LoRA kernels of T tokens depend on the rows per
  adapter (loramux_kernels.lora.mixed_min_rows), a step of T tokens with one adapter row among
  base rows (the `spread` LoRA path). Eager steps with adapters run slot 0 marked as
  holding every extra the pool has buffers for (LoRASlotPool.extras_marked: host-side
  sets only, restored after), so the extras' kernels (DoRA's row factors, embed_tokens
  over the T tokens, lm_head over the sampling rows) are compiled for every T; a step
  with fewer extras launches a subset of them. lm_head's LoRA also runs outside a
  non-greedy decode graph over its n <= max_num_seqs rows: with lm_head buffers, n =
  max_num_seqs - 1 is warmed too (every other count of token_counts(max_num_seqs) is
  some shape's sampling rows). tests/test_warmup.py records the kernels' launch keys
  and fails if a step after warm-up launches one the warm-up did not.

Only some eager shapes launch a variant no earlier shape did. The parallel compile's dry
run (engine/precompile.py) notes them (`CoveringShapes`) and keeps them with its cache
mark; a warm-up told them (`only`) runs just those shapes, and the largest one (the
caching allocator's peak), instead of every shape: each variant is then still launched
once, loaded from the disk cache, before serving. On an H200 that is a few dozen shapes
of 1,906.

Each eager step runs over a slice of the decoder layers (engine/warmup_layers.py: the
first, and one standing for the rest), which launches every variant the whole model does
at a fraction of the work; the graphs are captured over the whole model. Progress goes to
engine/startup.py's StartupProgress (the engine's heartbeats and a line on stderr).

Compiled kernels also persist on disk: the engine server points TRITON_CACHE_DIR at its
work dir (and the container image at a volume), so a restart loads instead of compiling.
"""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from loramux_engine.cuda_graph import GraphKey, decode_buckets
from loramux_engine.kernel_count import KernelCount
from loramux_engine.lora.pool import LoRAExtras
from loramux_engine.scheduler import ScheduledRequest, SchedulerOutput
from loramux_engine.startup import StartupProgress
from loramux_engine.warmup_layers import only_layers, representative_layers
from loramux_kernels import lora as lora_kernels


@dataclass(frozen=True)
class WarmupReport:
    seconds: float
    graphs: int          # CUDA graphs captured
    eager_steps: int     # eager forward passes run
    layers: int = 0      # decoder layers each eager step ran (engine/warmup_layers.py)
    eager_seconds: float = 0.0
    graph_seconds: float = 0.0
    kernels: KernelCount = KernelCount(-1, -1)

    def __str__(self) -> str:
        return (f"warm-up {self.seconds:.1f} s: {self.eager_steps} eager step shapes "
                f"({self.layers} layers each) in {self.eager_seconds:.1f} s, "
                f"{self.graphs} CUDA graphs captured in {self.graph_seconds:.1f} s, "
                f"{self.kernels}")


@dataclass(frozen=True)
class EagerShape:
    num_tokens: int      # T
    num_seqs: int        # s: s - 1 one-token rows (decodes), then one row with the rest
    context: int         # tokens already cached before this step, per sequence
    lora: bool
    spread: bool = False  # only the first row uses an adapter, the rest the base model


def mixed_variants(bucket: int, min_rows: int) -> tuple[bool, ...]:
    """The `spread` bits a decode batch in `bucket`, with adapters but not all on one,
    can have when a batch needs `min_rows` rows per adapter to go without it. A batch of
    `bucket` rows reaches each bit that any batch of the bucket reaches: spread with one
    adapter row among base rows (min_rows >= 2); not spread with min_rows rows of one
    adapter and a base row (min_rows + 1 rows; a mixed batch without it needs at least as
    many), or any mixed batch when min_rows is 0 or 1."""
    if bucket < 2:
        return ()
    out = []
    if min_rows < 2 or bucket >= min_rows + 1:
        out.append(False)
    if min_rows >= 2:
        out.append(True)
    return tuple(out)


def extras_subsets(allocated: LoRAExtras) -> list[LoRAExtras]:
    """Every combination of the `allocated` extras, none included."""
    subsets = [()]
    for bit in allocated:
        subsets = [s + (False,) for s in subsets] + ([s + (True,) for s in subsets]
                                                     if bit else [])
    return [LoRAExtras(*s) for s in subsets]


def graph_keys(max_num_seqs: int, min_rows: Mapping[int, int],
               extras: LoRAExtras = LoRAExtras()) -> list[GraphKey]:
    """Every GraphKey a decode step can need (`min_rows`: per bucket, as graph_key's;
    `extras`: what the slot pool has buffers for, LoRASlotPool.extras_allocated)."""
    keys = []
    combos = extras_subsets(extras)
    for bucket in decode_buckets(max_num_seqs):
        lora_kinds = [(True, False)] + [(False, spread) for spread in
                                        mixed_variants(bucket, min_rows[bucket])]
        for greedy in (False, True):
            keys.append(GraphKey(bucket, False, greedy))
            keys += [GraphKey(bucket, True, greedy, uniform, spread, *bits)
                     for uniform, spread in lora_kinds for bits in combos]
    return keys


def token_counts(limit: int) -> list[int]:
    """1..64, then powers of two, their neighbours and the multiples of 16 around them,
    up to `limit` (always included)."""
    counts = set(range(1, min(limit, 64) + 1))
    p = 64
    while p <= limit:
        counts.update(t for t in (p - 17, p - 16, p - 15, p - 1, p, p + 1, p + 15, p + 16,
                                  p + 17) if 0 < t <= limit)
        p *= 2
    counts.update(t for t in (limit - 1, limit) if t > 0)
    return sorted(counts)


def contexts(rest: int, max_model_len: int) -> list[int]:
    """Cached tokens per sequence to warm up with: none, a short context, and contexts that
    split the attention's key range into each power-of-two number of parts (a split every
    256 keys: kernels/attention_triton.py), up to the longest."""
    out = {0, min(40, max_model_len - rest), max(0, max_model_len - rest - 1)}
    length = 257
    while length < max_model_len:
        out.add(max(0, length - rest))
        length = 2 * length - 1
    return sorted(c for c in out if c + rest <= max_model_len)


def eager_shapes(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 graphs: bool, min_rows: Callable[[int], int],
                 head: bool = False) -> list[EagerShape]:
    """The eager steps the warm-up runs (module docstring); `min_rows(T)`: the rows per
    adapter a step of T tokens needs to go without the spread hint (0: no such hint);
    `head`: lm_head LoRA may run (over any number of sampling rows up to max_num_seqs)."""
    out = []
    n = max_num_seqs - 1
    if head and 0 < n <= max_num_batched_tokens and n not in token_counts(
            max_num_batched_tokens):
        out.append(EagerShape(n, n, 0, lora=True))
    for t in token_counts(max_num_batched_tokens):
        # spread: one adapter row (the LoRA kernels depend on T alone: one shape will do)
        m, s = min_rows(t), min(t, 2, max_num_seqs)
        if m >= 2 and (s == 2 or m > t):
            out.append(EagerShape(t, s, 0, lora=True, spread=True))
        seq_counts = {1, min(t, 2), min(t, max_num_seqs)}
        if not graphs:
            seq_counts.update({s for s in (3, 16, 17) if s <= min(t, max_num_seqs)})
        for s in sorted(seq_counts):
            rest = t - (s - 1)
            # the attention splits its key range only for small steps (few programs):
            # past 64 tokens one long context stands for them all
            ctxs = (contexts(rest, max_model_len) if t <= 64 else
                    sorted({0, max(0, max_model_len - rest - 1)}))
            for context in ctxs:
                if rest + context <= max_model_len:
                    # with an adapter: a step without one launches a subset of these
                    out.append(EagerShape(t, s, context, lora=True))
    # ... but for the norms, which a LoRA step may run fused with the shrink
    # (engine/lora/batch.py FUSED_NORM_SHRINK): their variants depend on the width only
    out.append(EagerShape(1, 1, 0, lora=False))
    return out


class CoveringShapes:
    """The eager shapes that launched a kernel variant first, in order: `at(shape)`
    before each eager step (None once they are done), `found()` at each new variant."""

    def __init__(self):
        self.current: EagerShape | None = None
        self.shapes: list[EagerShape] = []

    def at(self, shape: EagerShape | None) -> None:
        self.current = shape

    def found(self, *_) -> None:
        if self.current is not None and (not self.shapes or self.shapes[-1] != self.current):
            self.shapes.append(self.current)


def chosen_shapes(shapes: list[EagerShape], only) -> list[EagerShape]:
    """`shapes` kept where they are in `only` (None: all of them), and always the one of
    the most tokens (the largest step: the caching allocator's peak)."""
    if only is None:
        return shapes
    keep = set(only) | {max(shapes, key=lambda s: (s.num_tokens, s.context))}
    return [s for s in shapes if s in keep]


def warm_up(runner, num_kv_blocks: int, block_size: int, max_num_seqs: int,
            max_num_batched_tokens: int, max_model_len: int,
            progress: StartupProgress | None = None, only=None,
            on_shape=None) -> WarmupReport:
    """Run every eager shape over a slice of the layers that launches every kernel
    variant of the whole model (engine/warmup_layers.py), then capture every graph key
    (CUDA graphs on). The KV cache is written with garbage: call before any request (no
    block holds cached data yet). `progress`: told after each step and capture (the
    share of the work done: an eager step counts 1, a capture of the whole model one per
    layer). `only`: the eager shapes to run (`chosen_shapes`; None: all); `on_shape`:
    told each eager shape before it runs, then None (`CoveringShapes.at`)."""
    return WarmupPlan.of(runner, num_kv_blocks, block_size, max_num_seqs,
                         max_num_batched_tokens, max_model_len, only).run(
                             runner, progress, on_shape)


@dataclass(frozen=True)
class WarmupPlan:
    """One engine's warm-up, resolved: the layers its eager steps run over, the eager
    shapes and the graph keys, in order. Under tensor parallelism rank 0 resolves it and
    sends it to the workers as JSON (engine/distributed/plan.py OP_WARMUP), and every
    rank runs exactly this list: their collectives pair up whatever a worker would have
    resolved by itself."""
    num_kv_blocks: int
    block_size: int
    layers: tuple[int, ...]
    shapes: tuple[EagerShape, ...]
    keys: tuple[GraphKey, ...] = ()

    @classmethod
    def of(cls, runner, num_kv_blocks: int, block_size: int, max_num_seqs: int,
           max_num_batched_tokens: int, max_model_len: int, only=None) -> "WarmupPlan":
        """The warm-up `warm_up` runs (its arguments)."""
        graphs = runner.graphs
        extras = runner.lora_pool.extras_allocated   # what the eager steps mark slot 0 with
        shapes = chosen_shapes(eager_shapes(
            max_num_batched_tokens, max_num_seqs, max_model_len, graphs is not None,
            lambda t: mixed_min_rows(runner.device, t), head=extras.head), only)
        keys = graph_keys(graphs.buckets[-1], graphs.min_rows, extras) if graphs else []
        return cls(num_kv_blocks, block_size, tuple(representative_layers(runner)),
                   tuple(shapes), tuple(keys))

    def run(self, runner, progress: StartupProgress | None = None,
            on_shape=None) -> WarmupReport:
        start = time.perf_counter()
        count = KernelCount.start()
        report = _Progress(progress, len(self.shapes), len(self.keys), len(runner.kv_caches))
        # the eager steps' adapter rows use slot 0, marked as holding every extra
        with runner.lora_pool.extras_marked(0), only_layers(runner, list(self.layers)):
            for shape in self.shapes:
                if on_shape is not None:
                    on_shape(shape)
                _eager_step(runner, shape, self.num_kv_blocks, self.block_size)
                report.eager_step()
            if on_shape is not None:
                on_shape(None)
        eager_done = time.perf_counter()
        captured = 0
        for key in self.keys:   # one at a time: progress between captures
            captured += runner.graphs.capture_all([key])
            report.captured()
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        end = time.perf_counter()
        return WarmupReport(end - start, captured, len(self.shapes), len(self.layers),
                            eager_done - start, end - eager_done, count.done())

    def to_json(self) -> str:
        return json.dumps({"num_kv_blocks": self.num_kv_blocks,
                           "block_size": self.block_size, "layers": list(self.layers),
                           "shapes": [dataclasses.astuple(s) for s in self.shapes],
                           "keys": [list(k) for k in self.keys]})

    @classmethod
    def from_json(cls, text: str) -> "WarmupPlan":
        f = json.loads(text)
        return cls(f["num_kv_blocks"], f["block_size"], tuple(f["layers"]),
                   tuple(EagerShape(*s) for s in f["shapes"]),
                   tuple(GraphKey(*k) for k in f["keys"]))


def mixed_min_rows(device, num_tokens: int) -> int:
    """The LoRA kernels' rows per adapter below which a step of `num_tokens` tokens
    takes the spread path: the one place the warm-up reads the kernels' thresholds."""
    return lora_kernels.mixed_min_rows(device, num_tokens)


class _Progress:
    """Warm-up progress in work units: an eager step counts 1, a capture `layers`."""

    def __init__(self, progress, eager: int, graphs: int, layers: int):
        self._progress, self._eager, self._graphs = progress, eager, graphs
        self._per_graph = layers
        self._total = max(1, eager + graphs * layers)
        self._steps = self._captures = 0

    def eager_step(self) -> None:
        self._steps += 1
        self._tell(f"compiling eager step {self._steps}/{self._eager}")

    def captured(self) -> None:
        self._captures += 1
        self._tell(f"capturing decode graph {self._captures}/{self._graphs}")

    def _tell(self, detail: str) -> None:
        if self._progress is not None:
            done = self._steps + self._captures * self._per_graph
            self._progress.advance(detail, done / self._total)


@torch.no_grad()
def _eager_step(runner, shape: EagerShape, num_kv_blocks: int, block_size: int) -> None:
    """One forward pass (and greedy pick) of `shape` on garbage inputs."""
    rows = [1] * (shape.num_seqs - 1) + [shape.num_tokens - (shape.num_seqs - 1)]
    sched, next_block = [], 0
    for i, n in enumerate(rows):
        total = shape.context + n
        blocks = -(-total // block_size)
        ids = tuple((next_block + i) % num_kv_blocks for i in range(blocks))
        next_block += blocks
        req = SimpleNamespace(all_token_ids=[1] * total, sample_row=0)
        lora = shape.lora and not (shape.spread and i > 0)
        sched.append(ScheduledRequest(req, shape.context, n, ids, 0 if lora else -1,
                                      samples=True))
    inputs = runner.prepare_inputs(SchedulerOutput(scheduled=sched))
    runner.forward_pick(inputs)
