"""Start-up warm-up: compile every kernel variant and capture every CUDA graph the
configured limits can reach, before the engine serves, so that the first request after
"serving" runs like the millionth (no Triton compile, no graph capture mid-traffic).

What a step can look like is bounded by the config:
- A decode step of n <= max_num_seqs sequences replays the graph of its bucket, keyed
  (bucket, lora, greedy, uniform) (engine/cuda_graph.py): `graph_keys` lists them all and
  every one is captured.
- Any other step (prefill, mixed, decode with CUDA graphs off) runs eagerly over
  T <= max_num_batched_tokens tokens of s <= max_num_seqs sequences, with or without
  adapters. A kernel variant is a function of (T, s, context length) through the
  kernels' launch heuristics (thresholds at 16, 32, 64, 256, ... tokens) and Triton's
  integer specialisation (a value of 1, a multiple of 16): `eager_shapes` visits every
  token count up to 64, then every power of two and its neighbours and every multiple of
  16 next to them up to the limit, as decode-only, one-prefill and mixed steps, with
  short and long contexts. tests/test_warmup.py records the kernels' launch keys and
  fails if a step after warm-up launches one the warm-up did not.

Compiled kernels also persist on disk: the engine server points TRITON_CACHE_DIR at its
work dir (and the container image at a volume), so a restart loads instead of compiling.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from engine.cuda_graph import decode_buckets
from engine.scheduler import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class WarmupReport:
    seconds: float
    graphs: int          # CUDA graphs captured
    eager_steps: int     # eager forward passes run

    def __str__(self) -> str:
        return (f"warm-up {self.seconds:.1f} s: {self.graphs} CUDA graphs captured, "
                f"{self.eager_steps} eager step shapes compiled")


@dataclass(frozen=True)
class EagerShape:
    num_tokens: int      # T
    num_seqs: int        # s: s - 1 one-token rows (decodes), then one row with the rest
    context: int         # tokens already cached before this step, per sequence
    lora: bool


def graph_keys(max_num_seqs: int) -> list[tuple[int, bool, bool, bool]]:
    """Every (bucket, lora, greedy, uniform) a decode step can need."""
    keys = []
    for bucket in decode_buckets(max_num_seqs):
        for lora in (False, True):
            for greedy in (False, True):
                for uniform in ((False, True) if lora else (False,)):
                    keys.append((bucket, lora, greedy, uniform))
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
                 graphs: bool) -> list[EagerShape]:
    """The eager steps the warm-up runs (module docstring)."""
    out = []
    for t in token_counts(max_num_batched_tokens):
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


def warm_up(runner, num_kv_blocks: int, block_size: int, max_num_seqs: int,
            max_num_batched_tokens: int, max_model_len: int) -> WarmupReport:
    """Run every eager shape and capture every graph key (CUDA graphs on). The KV cache
    is written with garbage: call before any request (no block holds cached data yet)."""
    start = time.perf_counter()
    graphs = runner.graphs
    shapes = eager_shapes(max_num_batched_tokens, max_num_seqs, max_model_len,
                          graphs is not None)
    for shape in shapes:
        _eager_step(runner, shape, num_kv_blocks, block_size)
    captured = 0
    if graphs is not None:
        captured = graphs.capture_all(graph_keys(graphs.buckets[-1]))
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return WarmupReport(time.perf_counter() - start, captured, len(shapes))


@torch.no_grad()
def _eager_step(runner, shape: EagerShape, num_kv_blocks: int, block_size: int) -> None:
    """One forward pass (and greedy pick) of `shape` on garbage inputs."""
    rows = [1] * (shape.num_seqs - 1) + [shape.num_tokens - (shape.num_seqs - 1)]
    sched, next_block = [], 0
    for n in rows:
        total = shape.context + n
        blocks = -(-total // block_size)
        ids = tuple((next_block + i) % num_kv_blocks for i in range(blocks))
        next_block += blocks
        req = SimpleNamespace(all_token_ids=[1] * total, sample_row=0)
        sched.append(ScheduledRequest(req, shape.context, n, ids, 0 if shape.lora else -1,
                                      samples=True))
    inputs = runner.prepare_inputs(SchedulerOutput(scheduled=sched))
    runner.forward_pick(inputs)
