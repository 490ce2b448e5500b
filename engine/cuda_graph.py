"""CUDA graphs for decode steps: one graph per (batch-size bucket, LoRA mode).

A decode step (every scheduled sequence runs exactly one token) of n sequences replays the
graph of the smallest bucket >= n (buckets 1, 2, 4, ..., max_num_seqs); rows n..bucket-1
are padding that writes no KV (slot -1) and uses no adapter. Every input lives in static
device buffers, refilled per step from a pinned host mirror with two non-blocking copies:

    int64 [3, B]:        input ids | positions | KV slot mapping
    int32 [2B + B*W]:    seq lens | LoRA slot per token | block tables [B, W]

W = blocks of a max_model_len sequence. The LoRA metadata (`build_meta`: tokens grouped by
slot) is computed inside the graph from the static slot buffer, so one graph serves any
mix of adapters and base requests; adapter weights sit at fixed addresses in the slot
pool, so loading an adapter never invalidates a graph. Attention is captured with
max_seq_len = max_model_len, which fixes its split-KV count per graph (empty splits are
merged away). Batches without any adapter replay a graph without the LoRA launches;
batches whose rows all use one adapter replay a "uniform" graph, whose LoRA kernels were
captured with launch parameters tuned for one adapter (kernels/lora/token.py) and,
where the model keeps spare weight rows for one adapter, over those rows
(engine/lora/fused.py: the step's adapter is copied there before the replay when they
hold another, so such a graph serves only rows on one adapter, as its key says). Mixed
batches whose rows average fewer rows per adapter than the kernels' rule for the bucket
(`min_rows`, loramux_kernels.lora.mixed_min_rows)
replay a "spread" graph, captured on the token kernels where the other one has the
segment kernels (kernels/lora/plan.py); the bit is counted on the host from the
rows' slots. Graphs are captured at start-up (`capture_all`, engine/warmup.py), or else
the first time a `GraphKey` is needed.

Rows whose adapter is DoRA, or has LoRA on lm_head or embed_tokens, replay graphs that
also run those ops (GraphKey `dora`, `head`, `embed`, from the pool's host-side sets):
each op reads every row's slot (other rows get factor 1 or nothing), so one such graph
serves any mix. Their buffers are allocated at start (EngineConfig.lora_extras) or at
the first read of such an adapter, and never move; the start-up warm-up captures the
graphs of the extras that have buffers by then, any other is captured when first needed. DoRA factors of row-parallel
groups under tensor parallelism are settled (one all-reduce) before a LoRA step's
replay, outside the graph.

A "greedy" graph also runs lm_head and picks every row's token inside the graph (argmax
of the float32 logits and its raw log-softmax logprob: the Sampler's own ops for a greedy
row without penalty, kernels/greedy_pick.py; with GREEDY_PICK "triton" one Triton kernel
that reads the logits once), so such a step reads back one [2, n] tensor with one sync.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from loramux_engine.lora import LoRABatch, LoRASlotPool
from loramux_engine.lora.batch import fused_gemm, spread_over_adapters
from loramux_engine.lora.fused import FusedAdapter
from loramux_engine.lora.pool import LoRAExtras
from loramux_engine.scheduler import ScheduledRequest
from loramux_kernels import lora as lora_kernels
from loramux_kernels.attention_metadata import AttentionMetadata
from loramux_kernels.greedy_pick import greedy_pick

# How a greedy graph picks its rows' tokens: "torch" (the reference's four passes over
# the logits: float32 copy, argmax, log_softmax, gather) or "triton" (one read of them,
# kernels/greedy_pick_triton.py, on CUDA with Triton; the torch ops elsewhere). Read when
# a graph is captured: change it before capturing (or release the captured graphs).
# "triton" measured on an H200 (benchmarks/results/2026-11-27-h200-suite/decode-pick.log):
# 0.04-0.2 ms less per step at B 1-256 with adapters, base B=256 within noise.
GREEDY_PICK = "triton"
GREEDY_PICK_MODES = ("torch", "triton")


def decode_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two below `max_batch`, then `max_batch` itself."""
    assert max_batch >= 1, max_batch
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return tuple(out + [max_batch])


def bucket_for(buckets: tuple[int, ...], n: int) -> int | None:
    """Smallest bucket holding n rows, None when n exceeds them all."""
    return next((b for b in buckets if b >= n), None)


class GraphKey(NamedTuple):
    """What a decode graph was captured for: `bucket` rows; `lora`: any row uses an
    adapter; `greedy`: the graph also picks the tokens; `uniform`: every row uses the same
    adapter; `spread`: mixed rows averaging fewer rows per adapter than the bucket's
    `min_rows` (never with uniform); `dora`, `head`, `embed`: some row's adapter is DoRA,
    has LoRA on lm_head, on embed_tokens (engine/lora/pool.py LoRAExtras)."""
    bucket: int
    lora: bool
    greedy: bool
    uniform: bool = False
    spread: bool = False
    dora: bool = False
    head: bool = False
    embed: bool = False

    @property
    def extras(self) -> LoRAExtras:
        return LoRAExtras(self.dora, self.head, self.embed)


def graph_key(buckets: tuple[int, ...], scheduled: list[ScheduledRequest], greedy: bool,
              min_rows: Mapping[int, int], extras: LoRAExtras = LoRAExtras()) -> GraphKey:
    """The key of the graph a decode step of `scheduled` replays. `min_rows[bucket]`: the
    rows per adapter a mixed batch of that bucket needs to go without the spread hint
    (loramux_kernels.lora.mixed_min_rows; 0: the hint changes nothing there). `extras`: what the
    rows' slots need beyond the groups' LoRA (LoRASlotPool.extras_of)."""
    bucket = bucket_for(buckets, len(scheduled))
    slots = {s.slot for s in scheduled}
    use_lora = max(slots) >= 0
    uniform = use_lora and len(slots) == 1
    spread = (use_lora and not uniform
              and spread_over_adapters(((s.slot, 1) for s in scheduled), min_rows[bucket]))
    return GraphKey(bucket, use_lora, greedy, uniform, spread, *extras)


def is_decode_step(scheduled: list[ScheduledRequest]) -> bool:
    return bool(scheduled) and all(s.num_new_tokens == 1 for s in scheduled)


class DecodeStaging:
    """Static device buffers of a decode step's inputs and their pinned host mirror."""

    def __init__(self, max_batch: int, max_blocks: int, block_size: int, max_model_len: int,
                 device: torch.device):
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.block_size, self.max_model_len = block_size, max_model_len
        pin = device.type == "cuda"
        B = max_batch
        self.h64 = torch.zeros((3, B), dtype=torch.int64, pin_memory=pin)
        self.h32 = torch.zeros(2 * B + B * max_blocks, dtype=torch.int32, pin_memory=pin)
        self.d64 = torch.zeros_like(self.h64, device=device)
        self.d32 = torch.zeros_like(self.h32, device=device)
        self.qsl = torch.arange(B + 1, dtype=torch.int32, device=device)  # one token each
        self._n64, self._n32 = self.h64.numpy(), self.h32.numpy()  # share memory
        self._tables = self._n32[2 * B:].reshape(B, max_blocks)
        # the (immutable) block-id tuple each table row holds, so an unchanged row is
        # not rewritten; None = unknown
        self._rows: list[tuple[int, ...] | None] = [None] * B
        self._uploaded = torch.cuda.Event() if pin else None

    def fill(self, scheduled: list[ScheduledRequest], bucket: int) -> list[int]:
        """Host side: rows 0..n-1 from the scheduled decodes, n..bucket-1 padding.
        Returns the rows whose input token is still being sampled (async scheduling:
        written as 0 here, patched on the device after `upload`)."""
        self._wait_for_upload()
        n, B, bs = len(scheduled), self.max_batch, self.block_size
        assert n <= bucket <= B, (n, bucket, B)
        ids, pos, slot_map = self._n64
        rows, tables = self._rows, self._tables
        cols: tuple[list[int], ...] = ([], [], [], [])  # ids, positions, slot map, LoRA slots
        holes: list[int] = []
        for i, s in enumerate(scheduled):
            p, blocks, toks = s.start, s.block_ids, s.request.all_token_ids
            if p < len(toks):
                cols[0].append(toks[p])
            else:
                cols[0].append(0)
                holes.append(i)
            cols[1].append(p)
            cols[2].append(blocks[p // bs] * bs + p % bs)
            cols[3].append(s.slot)
            if rows[i] is not blocks:  # the scheduler reuses a table's tuple until it grows
                tables[i, :len(blocks)] = blocks
                rows[i] = blocks if type(blocks) is tuple else None
        ids[:n], pos[:n], slot_map[:n] = cols[0], cols[1], cols[2]
        self._n32[:n] = pos[:n] + 1  # seq lens
        self._n32[B:B + n] = cols[3]
        self._pad(n, bucket)
        return holes

    def fill_padding(self, start: int, stop: int) -> None:
        """Host side: rows [start, stop) padding, the rest as they are (a capture's
        inputs)."""
        self._wait_for_upload()
        self._pad(start, stop)

    def _wait_for_upload(self) -> None:
        """Block until the last upload has read the host mirror. Its copies are queued
        behind the step in flight and read the mirror when they run, not when queued: a
        write before then would change that step's inputs."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def _pad(self, start: int, stop: int) -> None:
        """Rows [start, stop): token 0 at position 0, no KV write, no adapter."""
        B = self.max_batch
        self._n64[0, start:stop] = 0
        self._n64[1, start:stop] = 0
        self._n64[2, start:stop] = -1
        self._n32[start:stop] = 1
        self._n32[B + start:B + stop] = -1
        self._tables[start:stop] = 0
        self._rows[start:stop] = [None] * (stop - start)

    def upload(self) -> None:
        """Device side: two copies, asynchronous from pinned memory on CUDA."""
        self.d64.copy_(self.h64, non_blocking=True)
        self.d32.copy_(self.h32, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()

    def views(self, bucket: int) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids, attention metadata, token_slots) over the first `bucket` rows."""
        B, W = self.max_batch, self.max_blocks
        attn = AttentionMetadata(
            positions=self.d64[1, :bucket], slot_mapping=self.d64[2, :bucket],
            query_start_loc=self.qsl[:bucket + 1], seq_lens=self.d32[:bucket],
            block_tables=self.d32[2 * B:].view(B, W)[:bucket],
            max_query_len=1, max_seq_len=self.max_model_len, block_size=self.block_size)
        return self.d64[0, :bucket], attn, self.d32[B:B + bucket]


class CudaGraphRunner:
    """Replays captured decode graphs; `run(scheduled, key)` -> hidden [n, hidden], or
    [2, n] (token id, logprob) for a greedy key (views of the graph's static output,
    valid until the next replay)."""

    def __init__(self, model, kv_caches, lora_pool: LoRASlotPool, block_size: int,
                 max_batch: int, max_model_len: int, device: torch.device,
                 fused: FusedAdapter | None = None):
        """`fused`: the model's spare weight rows for one adapter (engine/lora/fused.py):
        uniform graphs captured over them, filled with the step's adapter before a replay."""
        self.model, self.kv_caches, self.lora_pool = model, kv_caches, lora_pool
        self.fused = fused
        self._fused_keys: set[GraphKey] = set()   # graphs captured over the spare rows
        self.buckets = decode_buckets(max_batch)
        max_blocks = -(-max_model_len // block_size)
        self.staging = DecodeStaging(max_batch, max_blocks, block_size, max_model_len, device)
        self.min_rows = {b: lora_kernels.mixed_min_rows(device, b) for b in self.buckets}
        self._graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.num_replays = 0

    def release(self, wait: bool = True) -> None:
        """Destroy every captured graph (they are captured again when needed). Under
        tensor parallelism this comes before NCCL's teardown: a graph that captured NCCL
        kernels holds resources of the communicator until it is destroyed. `wait=False`
        when a rank is lost: a replay in flight may then spin in an all-reduce until the
        communicator is aborted, and a device synchronize here would never return (CUDA
        destroys a graph still running once it completes)."""
        self._graphs.clear()
        self._fused_keys.clear()
        self._pool = None
        if wait:
            torch.cuda.synchronize()

    def can_run(self, scheduled: list[ScheduledRequest]) -> bool:
        return is_decode_step(scheduled) and len(scheduled) <= self.buckets[-1]

    @property
    def captured(self) -> list[tuple[int, bool]]:
        """(bucket, lora) pairs with a captured graph (greedy or not)."""
        return sorted({key[:2] for key in self._graphs})

    def capture_all(self, keys) -> int:
        """Capture every GraphKey of `keys` not captured yet (the start-up warm-up:
        engine/warmup.py); returns how many were captured."""
        todo = [k for k in map(GraphKey._make, keys) if k not in self._graphs]
        for key in todo:
            self._graphs[key] = self._capture(key)
        return len(todo)

    @property
    def graph_keys(self) -> list[GraphKey]:
        return sorted(self._graphs)

    def key_for(self, scheduled: list[ScheduledRequest], greedy: bool) -> GraphKey:
        """The key of the graph a decode step of `scheduled` replays (`graph_key`)."""
        slots = [s.slot for s in scheduled]
        extras = self.lora_pool.extras_of(slots) if max(slots) >= 0 else LoRAExtras()
        return graph_key(self.buckets, scheduled, greedy, self.min_rows, extras)

    def head_lora(self, key: GraphKey) -> LoRABatch | None:
        """After a replay of `key` (not greedy), the LoRA of lm_head for the replayed rows
        (compute_logits runs outside the graph then), or None when none of them has any."""
        if not key.head:
            return None
        _, _, token_slots = self.staging.views(key.bucket)
        return LoRABatch(self.lora_pool, token_slots, extras=LoRAExtras(head=True))

    def graph_for(self, key: GraphKey):
        """The captured graph of `key`, or None (benchmarks time its replay)."""
        entry = self._graphs.get(key)
        return entry[0] if entry else None

    def run(self, scheduled: list[ScheduledRequest], key: GraphKey,
            patch=None) -> torch.Tensor:
        """Replays the graph of `key` (`key_for(scheduled, ...)`) for `scheduled`.
        `patch(input_ids, rows)`, when given, writes the in-flight input tokens of `rows`
        into the static input-id buffer on the device before the replay."""
        if key.lora:  # DoRA factors of row-parallel groups loaded since the last step
            self.lora_pool.settle_dora()
        if key not in self._graphs:
            self._graphs[key] = self._capture(key)
        graph, out = self._graphs[key]
        if key in self._fused_keys:   # its adapter into the spare rows, outside the graph
            self.fused.install(scheduled[0].slot)
        holes = self.staging.fill(scheduled, key.bucket)
        self.staging.upload()
        if holes:
            assert patch is not None, "in-flight input tokens without a previous step"
            patch(self.staging.d64[0], holes)
        graph.replay()
        self.num_replays += 1
        return out[:, :len(scheduled)] if key.greedy else out[:len(scheduled)]

    def _fused_for(self, key: GraphKey) -> FusedAdapter | None:
        """The spare rows a graph of `key` is captured over: uniform keys, where the
        step takes the fused GEMM (engine/lora/batch.py fused_gemm)."""
        return fused_gemm(self.fused, key.bucket, key.extras) if key.uniform else None

    def _forward(self, key: GraphKey) -> torch.Tensor:
        ids, attn, token_slots = self.staging.views(key.bucket)
        lora = (LoRABatch(self.lora_pool, token_slots, uniform=key.uniform, spread=key.spread,
                          extras=key.extras, fused=self._fused_for(key))
                if key.lora else None)
        hidden = self.model.forward(ids, attn, self.kv_caches, lora)
        if not key.greedy:
            return hidden
        assert GREEDY_PICK in GREEDY_PICK_MODES, GREEDY_PICK
        return greedy_pick(self.model.compute_logits(hidden, lora),
                           kernel=GREEDY_PICK == "triton")

    def _capture(self, key: GraphKey):
        # Inputs of the warm-up and the capture: all padding (no KV writes, no adapter).
        self.staging.fill_padding(0, key.bucket)
        self.staging.upload()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # compiles the Triton kernels outside the capture
            self._forward(key)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the adapter reader thread may pin host memory meanwhile, which
        # in the default (global) mode invalidates the capture (seen on an H200)
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._forward(key)
        torch.cuda.synchronize()
        if self._fused_for(key) is not None:
            self._fused_keys.add(key)
        return graph, out
