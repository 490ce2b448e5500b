"""The model runner: turns a scheduled step into tensors, runs the model, samples.

`prepare_inputs` (host bookkeeping -> tensors) is kept apart from `execute` (device work),
so a CUDA runner can replace the former with static buffers and the latter with graph
replays for decode-only steps without touching the scheduler.

On CUDA the step inputs are built on the host, pinned, and copied without blocking; decode
steps replay CUDA graphs (engine/cuda_graph.py) unless `graph_max_batch` is 0. The only
host sync of a step is the read of the sampled tokens.

`run(out)` is one step, start to end. `launch(out, prev)` only queues it and returns a
PendingSample (engine/pending.py): with async scheduling the engine launches step N+1
before reading step N's tokens. An input token of N+1 that N is still sampling (a
"placeholder", the position just past a request's known tokens) is written as 0 on the
host and replaced on the device by a gather from `prev.tokens` at the request's row
(`Request.sample_row`, set at N's launch), before the forward pass or graph replay.

Two ways to pick a step's tokens. The Sampler (engine/sampling/) serves every request.
The greedy pick (`loramux_kernels.greedy_pick`: each row's argmax and its logprob, the
Sampler's own ops for such rows) serves a step whose every sampling row is plain greedy,
where it pays: inside the greedy CUDA graph on a pure decode step, and, under tensor
parallelism, on eager steps too. Every rank computes the same all-gathered logits, so
every rank picks the same tokens and keeps them on its device: a worker's next step can
fill its placeholders from its own copy, which is what lets a tensor-parallel step be
launched before the previous one's tokens are read (`PendingSample.tokens_on_every_rank`).
`takes_greedy_pick` is the one place that decides. Steps the Sampler serves under tensor
parallelism get there by one broadcast of rank 0's sampled tokens (`_sample`).

Constrained rows (engine/structured/). `launch(..., masks=source)`: once the step's logits
are queued, and before its Sampler runs, the runner calls `source(requests)` for the
allowed-token bitmask of the constrained sampling rows; on CUDA the host fills it while
the forward pass runs, copies it without blocking and the Sampler applies it on the
device. Such a step never takes the greedy pick (which has no mask): a decode step then
replays the plain graph and samples after it. Only rank 0 samples, so only it masks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from loramux_engine.cuda_graph import CudaGraphRunner, is_decode_step
from loramux_engine.lora import LoRABatch, LoRASlotPool
from loramux_engine.lora.batch import fused_gemm, spread_over_adapters
from loramux_engine.lora.fused import FusedAdapter
from loramux_engine.lora.pool import LoRAExtras
from loramux_engine.model.batch import make_attention_metadata
from loramux_engine.parallel import TPGroup
from loramux_engine.pending import PendingSample
from loramux_engine.request import Request
from loramux_engine.sampling import Sampler
from loramux_engine.scheduler import Sampled, ScheduledRequest, SchedulerOutput
from loramux_kernels import lora as lora_kernels
from loramux_kernels.attention_metadata import AttentionMetadata
from loramux_kernels.greedy_pick import greedy_pick

# a step's sampling requests -> (constrained rows, their bitmask on the host) or None
MaskSource = Callable[[list[Request]], "tuple[list[int], torch.Tensor] | None"]


@dataclass
class ModelInputs:
    """Everything one forward pass reads."""
    input_ids: torch.Tensor        # [T] int64, flat over sequences
    attn: AttentionMetadata
    token_slots: torch.Tensor      # [T] int32 LoRA slot per token, -1 = base
    logits_indices: torch.Tensor   # [S] flat index of the last token of each sampling seq
    sample_requests: list[Request]  # the S requests that sample, in row order
    has_lora: bool                 # any token uses an adapter (known on the host: no sync)
    lora_spread: bool = False      # few rows per adapter (LoRABatch's `spread`; the host's)
    lora_extras: LoRAExtras = LoRAExtras()  # DoRA, lm_head, embed_tokens rows (the host's)
    holes: tuple[list[int], list[int]] = ([], [])  # placeholder: flat index, row in prev
    lora_slot: int = -1            # the one slot of every token, else -1 (the host's)


class ModelRunner:
    def __init__(self, model, kv_caches, lora_pool: LoRASlotPool, block_size: int,
                 device: torch.device | str = "cpu", sampler: Sampler | None = None,
                 graph_max_batch: int = 0, max_model_len: int = 0,
                 tp: TPGroup = TPGroup.single()):
        """graph_max_batch > 0 (CUDA only): decode steps of up to that many sequences
        replay CUDA graphs; max_model_len bounds their block tables and attention range.
        `tp`: this rank's group (the model's); at size > 1 rank 0's sampled tokens are
        broadcast to every rank (`_sample`)."""
        self.model = model
        self.tp = tp
        self.kv_caches = kv_caches
        self.lora_pool = lora_pool
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = sampler or Sampler()
        self.graphs = None
        self.num_launches = 0
        # the model's spare weight rows for one adapter (engine/lora/fused.py), if any
        targets = model.fused_lora_weights()
        self.fused = FusedAdapter(lora_pool, targets) if targets else None
        if graph_max_batch > 0 and self.device.type == "cuda":
            self.graphs = CudaGraphRunner(model, kv_caches, lora_pool, block_size,
                                          graph_max_batch, max_model_len, self.device,
                                          fused=self.fused)

    def release_graphs(self, wait: bool = True) -> None:
        """Destroy the captured decode graphs (CUDA), e.g. before the engine closes;
        `wait=False`: without waiting for the device (see CudaGraphRunner.release)."""
        if self.graphs is not None:
            self.graphs.release(wait)

    def prepare_inputs(self, out: SchedulerOutput) -> ModelInputs:
        ids: list[int] = []
        slots: list[int] = []
        last: list[int] = []
        samplers: list[Request] = []
        holes: tuple[list[int], list[int]] = ([], [])
        for s in out.scheduled:
            toks = s.request.all_token_ids
            ids.extend(toks[s.start:s.start + s.num_new_tokens])
            if s.start + s.num_new_tokens > len(toks):  # the last input is in flight
                ids.append(0)
                holes[0].append(len(ids) - 1)
                holes[1].append(s.request.sample_row)
            slots.extend([s.slot] * s.num_new_tokens)
            if s.samples:
                last.append(len(ids) - 1)
                samplers.append(s.request)
        attn = make_attention_metadata(
            [list(s.block_ids) for s in out.scheduled],
            [s.start for s in out.scheduled],
            [s.num_new_tokens for s in out.scheduled],
            self.block_size, "cpu")
        to_dev = self._to_device
        attn.positions, attn.slot_mapping = to_dev(attn.positions), to_dev(attn.slot_mapping)
        attn.query_start_loc, attn.seq_lens = to_dev(attn.query_start_loc), to_dev(attn.seq_lens)
        attn.block_tables = to_dev(attn.block_tables)
        has_lora = any(s.slot >= 0 for s in out.scheduled)
        spread, extras, lora_slot = False, LoRAExtras(), -1
        if has_lora:
            spread = spread_over_adapters(((s.slot, s.num_new_tokens) for s in out.scheduled),
                                          lora_kernels.mixed_min_rows(self.device, len(ids)))
            extras = self.lora_pool.extras_of(s.slot for s in out.scheduled)
            used = {s.slot for s in out.scheduled}
            lora_slot = used.pop() if len(used) == 1 else -1
        return ModelInputs(
            input_ids=to_dev(torch.tensor(ids, dtype=torch.int64)),
            attn=attn,
            token_slots=to_dev(torch.tensor(slots, dtype=torch.int32)),
            logits_indices=to_dev(torch.tensor(last, dtype=torch.int64)),
            sample_requests=samplers,
            has_lora=has_lora, lora_spread=spread, lora_extras=extras, holes=holes,
            lora_slot=lora_slot)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host tensor -> device; on CUDA through pinned memory without blocking (the
        caching host allocator keeps the pinned block alive until the copy is done)."""
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _fill_holes(self, input_ids: torch.Tensor, holes: tuple[list[int], list[int]],
                    prev: PendingSample | None) -> None:
        """Placeholder inputs <- the previous step's sampled tokens, on the device."""
        if not holes[0]:
            return
        assert prev is not None and prev.tokens is not None, "placeholder without a step"
        dst = self._to_device(torch.tensor(holes[0], dtype=torch.int64))
        src = self._to_device(torch.tensor(holes[1], dtype=torch.int64))
        input_ids.index_copy_(0, dst, prev.tokens.index_select(0, src))

    @torch.no_grad()
    def execute(self, inputs: ModelInputs, prev: PendingSample | None = None,
                greedy: bool = False, masks: MaskSource | None = None) -> PendingSample:
        """Forward pass, logits for the sampling rows only, then the sampler (or, with
        `greedy`, the greedy pick: see the module docstring)."""
        self._fill_holes(inputs.input_ids, inputs.holes, prev)
        hidden, lora = self._forward(inputs)
        if not inputs.sample_requests:
            return PendingSample.known({}, [], self.device)
        logits = self._logits(inputs, hidden, lora)
        if greedy:
            return self._greedy_pending(inputs.sample_requests, greedy_pick(logits))
        return self._sample(logits, inputs.sample_requests, masks)

    def _forward(self, inputs: ModelInputs) -> tuple[torch.Tensor, LoRABatch | None]:
        fused = None
        if inputs.lora_slot >= 0:   # one adapter for every token: it may ride in the GEMMs
            fused = fused_gemm(self.fused, inputs.token_slots.shape[0], inputs.lora_extras)
            if fused is not None:
                fused.install(inputs.lora_slot)
        lora = (LoRABatch(self.lora_pool, inputs.token_slots, spread=inputs.lora_spread,
                          extras=inputs.lora_extras, fused=fused)
                if inputs.has_lora else None)
        return self.model.forward(inputs.input_ids, inputs.attn, self.kv_caches, lora), lora

    def _logits(self, inputs: ModelInputs, hidden: torch.Tensor,
                lora: LoRABatch | None) -> torch.Tensor:
        """Logits of the sampling rows; the batch's LoRA also reaches lm_head."""
        return self.model.compute_logits(hidden[inputs.logits_indices], lora,
                                         inputs.logits_indices)

    @torch.no_grad()
    def forward_pick(self, inputs: ModelInputs) -> torch.Tensor:
        """Forward pass and the greedy pick of the sampling rows, nothing recorded: the
        kernels an eager step launches (start-up warm-up, engine/warmup.py)."""
        return greedy_pick(self._logits(inputs, *self._forward(inputs)))

    def _greedy_pending(self, requests: list[Request], picked: torch.Tensor) -> PendingSample:
        """The greedy pick's [2, n] output as a step result; a TP worker (no Sampler) keeps
        only the token ids on its device, for its next step's placeholders."""
        if type(self.sampler) is Sampler:
            return PendingSample.of_greedy_graph(requests, picked)
        return PendingSample.device_only(requests, picked[0].long())

    def _sample(self, logits: torch.Tensor, requests: list[Request],
                masks: MaskSource | None = None) -> PendingSample:
        """The Sampler's (or a custom sampler's) tokens. Under tensor parallelism only rank
        0 samples, then one broadcast leaves its tokens on every rank's device (a worker
        receives them in place of sampling), like the greedy pick's."""
        if self.tp.size == 1:
            return self._sample_here(logits, requests, masks)
        if self.tp.is_first:
            pending = self._sample_here(logits, requests, masks)
        else:
            pending = PendingSample.device_only(requests, torch.empty(
                len(requests), dtype=torch.int64, device=self.device))
        self.tp.broadcast(pending.tokens)
        pending.tokens_on_every_rank = True
        return pending

    def _sample_here(self, logits: torch.Tensor, requests: list[Request],
                     masks: MaskSource | None) -> PendingSample:
        states = [r.sampling_state for r in requests]
        mask = self._mask_on_device(masks, requests)
        if type(self.sampler) is Sampler:
            return PendingSample.of_sampler(requests,
                                            self.sampler.sample_tensors(logits, states, mask))
        res = (self.sampler.sample(logits, states) if mask is None  # a custom sampler:
               else self.sampler.sample(logits, states, mask))      # host lists
        sampled = {r.request_id: Sampled(tok, lp, top)
                   for r, tok, lp, top in zip(requests, res.token_ids, res.logprobs,
                                              res.top_logprobs)}
        return PendingSample.known(sampled, [r for r in requests if r.request_id in sampled],
                                   self.device)

    def _mask_on_device(self, masks: MaskSource | None, requests: list[Request]):
        """The constrained rows' bitmask, filled now (the logits are queued: on CUDA
        this overlaps the forward pass) and copied without blocking; None if none."""
        filled = masks(requests) if masks is not None else None
        if filled is None:
            return None
        rows, bitmask = filled
        rows = self._to_device(torch.tensor(rows, dtype=torch.int64))
        if self.device.type == "cuda":  # already page-locked (engine/structured/masks.py)
            return rows, bitmask.to(self.device, non_blocking=True)
        return rows, bitmask

    @torch.no_grad()
    def run_graph(self, out: SchedulerOutput, prev: PendingSample | None = None,
                  greedy: bool = False, masks: MaskSource | None = None) -> PendingSample:
        """A decode-only step through the CUDA graph of its batch-size bucket; `greedy`
        (see `takes_greedy_pick`) replays the graph that also picks every row's token."""
        sched = out.scheduled
        key = self.graphs.key_for(sched, greedy)
        patch = None
        if prev is not None:
            def patch(input_ids: torch.Tensor, rows: list[int]) -> None:
                self._fill_holes(input_ids, (rows, [sched[i].request.sample_row for i in rows]),
                                 prev)
        requests = [s.request for s in sched]
        if greedy:
            picked = self.graphs.run(sched, key, patch=patch)
            return self._greedy_pending(requests, picked)
        hidden = self.graphs.run(sched, key, patch=patch)
        rows = [i for i, s in enumerate(sched) if s.samples]
        if not rows:
            return PendingSample.known({}, [], self.device)
        picked = None
        if len(rows) < len(sched):
            picked = self._to_device(torch.tensor(rows, dtype=torch.int64))
            hidden = hidden[picked]
            requests = [requests[i] for i in rows]
        logits = self.model.compute_logits(hidden, self.graphs.head_lora(key), picked)
        return self._sample(logits, requests, masks)

    def takes_greedy_pick(self, sched: list[ScheduledRequest],
                          tensor_parallel: bool = False) -> bool:
        """Whether a step takes the greedy pick instead of the Sampler (see the module
        docstring). Never without the default Sampler, nor unless every sampling row is
        plain greedy (no penalty, no top logprobs, no constraint). Then: a step that replays a CUDA graph
        takes it when it is a pure decode step in which every row samples (the greedy
        graph); an eager step (prefill, mixed, the CPU) only under tensor parallelism,
        where it leaves the tokens on every rank. Only rank 0 can decide (the workers have
        no Sampler): its step plan carries the decision (`launch(out, prev, greedy)`)."""
        if type(self.sampler) is not Sampler or not all(
                _plain_greedy(s.request.params) for s in sched if s.samples):
            return False
        if self._replays_graph(sched):
            return is_decode_step(sched) and all(s.samples for s in sched)
        return tensor_parallel

    def _replays_graph(self, sched: list[ScheduledRequest]) -> bool:
        return self.graphs is not None and self.graphs.can_run(sched)

    def launch(self, out: SchedulerOutput, prev: PendingSample | None = None,
               greedy: bool | None = None, masks: MaskSource | None = None) -> PendingSample:
        """Queue one step on the device; `prev`: the launched step whose tokens this
        one's placeholder inputs take. Sets each sampling request's `sample_row`.
        `greedy`: this step takes the greedy pick; None: this runner decides for one
        device (`takes_greedy_pick`). Under tensor parallelism every rank passes rank 0's
        decision. `masks`: the constrained rows' bitmask source (module docstring)."""
        if greedy is None:
            greedy = self.takes_greedy_pick(out.scheduled)
        if self._replays_graph(out.scheduled):
            pending = self.run_graph(out, prev, greedy, masks)
        else:
            pending = self.execute(self.prepare_inputs(out), prev, greedy, masks)
        # a step that samples nothing leaves no placeholder to fill
        pending.tokens_on_every_rank |= bool(greedy) or not pending.requests
        for i, req in enumerate(pending.requests):
            req.sample_row = i
            # the sampler's step count includes this token from now on; the engine
            # writes the token in when the step is updated
            if req.sampling_state is not None:
                req.sampling_state.output_token_ids.append(-1)
                pending.needs_history |= req.needs_history
        self.num_launches += 1
        return pending

    def run(self, out: SchedulerOutput, greedy: bool | None = None) -> dict[str, Sampled]:
        """One whole step: launch, then wait for its tokens."""
        return self.launch(out, greedy=greedy).result()


def _plain_greedy(params) -> bool:
    """Sampled by the greedy pick exactly as by the Sampler: nothing it leaves out."""
    return (params.greedy and not params.top_logprobs and params.repetition_penalty == 1.0
            and params.structured is None)
