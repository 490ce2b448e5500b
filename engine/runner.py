"""The model runner: turns a scheduled step into tensors, runs the model, samples.

`prepare_inputs` (host bookkeeping -> tensors) is kept apart from `execute` (device work),
so a CUDA runner can replace the former with static buffers and the latter with graph
replays for decode-only steps without touching the scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.lora import LoRABatch, LoRASlotPool
from engine.model.batch import AttentionMetadata, make_attention_metadata
from engine.request import Request
from engine.sampling import Sampler
from engine.scheduler import Sampled, SchedulerOutput


@dataclass
class ModelInputs:
    """Everything one forward pass reads."""
    input_ids: torch.Tensor        # [T] int64, flat over sequences
    attn: AttentionMetadata
    token_slots: torch.Tensor      # [T] int32 LoRA slot per token, -1 = base
    logits_indices: torch.Tensor   # [S] flat index of the last token of each sampling seq
    sample_requests: list[Request]  # the S requests that sample, in row order
    has_lora: bool                 # any token uses an adapter (known on the host: no sync)


class ModelRunner:
    def __init__(self, model, kv_caches, lora_pool: LoRASlotPool, block_size: int,
                 device: torch.device | str = "cpu", sampler: Sampler | None = None):
        self.model = model
        self.kv_caches = kv_caches
        self.lora_pool = lora_pool
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = sampler or Sampler()

    def prepare_inputs(self, out: SchedulerOutput) -> ModelInputs:
        ids: list[int] = []
        slots: list[int] = []
        last: list[int] = []
        samplers: list[Request] = []
        for s in out.scheduled:
            ids.extend(s.request.all_token_ids[s.start:s.start + s.num_new_tokens])
            slots.extend([s.slot] * s.num_new_tokens)
            if s.samples:
                last.append(len(ids) - 1)
                samplers.append(s.request)
        attn = make_attention_metadata(
            [list(s.block_ids) for s in out.scheduled],
            [s.start for s in out.scheduled],
            [s.num_new_tokens for s in out.scheduled],
            self.block_size, self.device)
        dev = self.device
        return ModelInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            attn=attn,
            token_slots=torch.tensor(slots, dtype=torch.int32, device=dev),
            logits_indices=torch.tensor(last, dtype=torch.int64, device=dev),
            sample_requests=samplers,
            has_lora=any(s.slot >= 0 for s in out.scheduled))

    @torch.no_grad()
    def execute(self, inputs: ModelInputs) -> dict[str, Sampled]:
        """Forward pass, logits for the sampling rows only, then the sampler."""
        lora = LoRABatch(self.lora_pool, inputs.token_slots) if inputs.has_lora else None
        hidden = self.model.forward(inputs.input_ids, inputs.attn, self.kv_caches, lora)
        if not inputs.sample_requests:
            return {}
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        states = [r.sampling_state for r in inputs.sample_requests]
        res = self.sampler.sample(logits, states)
        return {r.request_id: Sampled(tok, lp, top)
                for r, tok, lp, top in zip(inputs.sample_requests, res.token_ids,
                                           res.logprobs, res.top_logprobs)}

    def run(self, out: SchedulerOutput) -> dict[str, Sampled]:
        return self.execute(self.prepare_inputs(out))
