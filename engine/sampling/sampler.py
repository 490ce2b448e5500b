"""Batched token sampling for requests with different sampling parameters.

Logprobs are taken from the RAW model logits (log_softmax before repetition penalty,
a constraint's token mask, temperature and truncation): they report what the model
believes, comparable across requests whatever their sampling settings, like the OpenAI
API and vLLM's default.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from loramux_engine.sampling.mask import apply_token_bitmask
from loramux_engine.sampling.noise import gumbel_noise
from loramux_engine.sampling.processors import (apply_min_p, apply_repetition_penalty,
                                                apply_top_k_top_p)
from loramux_engine.sampling.state import SamplingState
from loramux_core.sampling import GREEDY_TEMPERATURE


@dataclass(frozen=True)
class SamplerOutput:
    """One token per batch row, with its raw-logit logprob and, where the request asked
    for top_logprobs=k, the k most likely ids -> logprob (sorted by logprob, descending)."""
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]


@dataclass(frozen=True)
class SampledTensors:
    """A sample() result still in tensors (on the device: no host sync taken yet), so a
    caller can copy it to the host asynchronously and feed `token_ids` to the next step."""
    token_ids: torch.Tensor            # [B] int64
    logprobs: torch.Tensor             # [B] float32
    top_values: torch.Tensor | None    # [B, k] raw logprobs of the k most likely ids
    top_ids: torch.Tensor | None       # [B, k]
    top_wanted: tuple[int, ...]        # per row: how many of the k it asked for (0 = none)

    def to_output(self) -> SamplerOutput:
        if self.top_values is None:
            top = [None] * len(self.top_wanted)
        else:
            values, ids = self.top_values.tolist(), self.top_ids.tolist()
            top = [dict(zip(ids[i][:w], values[i][:w])) if w else None
                   for i, w in enumerate(self.top_wanted)]
        return SamplerOutput(token_ids=self.token_ids.tolist(),
                             logprobs=self.logprobs.tolist(), top_logprobs=top)


class Sampler:
    """Picks the next token of every row of a logits batch [B, V].

    Greedy rows (temperature 0) take the argmax of the penalised logits, as HF greedy
    search does. Other rows sample with the Gumbel-max trick: argmax(processed logits +
    Gumbel noise), the noise keyed by the row's seed and step (sampling/noise.py, one draw
    for the whole batch), so a row's token depends only on its logits, its parameters,
    its seed and its step. A constrained row's forbidden tokens (`mask`: rows and their
    bitmask on the logits' device, see sampling/mask.py) are set to -inf after the
    penalty, before the greedy pick or the sampling."""

    def sample(self, logits: torch.Tensor, states: list[SamplingState],
               mask: tuple[torch.Tensor, torch.Tensor] | None = None) -> SamplerOutput:
        return self.sample_tensors(logits, states, mask).to_output()

    def sample_tensors(self, logits: torch.Tensor, states: list[SamplingState],
                       mask: tuple[torch.Tensor, torch.Tensor] | None = None) -> SampledTensors:
        """sample() without reading the result back to the host."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} must be [len(states)={len(states)}, V]")
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        penalised = self._penalise(logits, states)
        if mask is not None:
            if penalised is logits:  # the raw logits stay the logprobs' source
                penalised = logits.clone()
            apply_token_bitmask(penalised, *mask)
        greedy = [s.params.greedy for s in states]
        token_ids = penalised.argmax(dim=-1)
        if not all(greedy):
            sampled = self._sample_rows(penalised, states, greedy)
            is_greedy = torch.tensor(greedy, device=logits.device)
            token_ids = torch.where(is_greedy, token_ids, sampled)
        chosen = raw_logprobs.gather(1, token_ids[:, None])[:, 0]
        wanted = tuple(min(s.params.top_logprobs, raw_logprobs.shape[-1]) for s in states)
        values = ids = None
        if max(wanted, default=0) > 0:
            values, ids = raw_logprobs.topk(max(wanted), dim=-1)
        return SampledTensors(token_ids, chosen, values, ids, wanted)

    @staticmethod
    def _penalise(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        rows = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
        if not rows:
            return logits
        penalty = torch.tensor([states[i].params.repetition_penalty for i in rows],
                               dtype=logits.dtype, device=logits.device)
        seen = [sorted(states[i].seen_token_ids()) for i in rows]
        return apply_repetition_penalty(logits, torch.tensor(rows, device=logits.device),
                                        seen, penalty)

    @staticmethod
    def _sample_rows(logits: torch.Tensor, states: list[SamplingState],
                     greedy: list[bool]) -> torch.Tensor:
        """Sampled token of every row (greedy rows get a harmless dummy)."""
        device, vocab = logits.device, logits.shape[-1]
        params = [s.params for s in states]
        temperature = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                   dtype=logits.dtype, device=device)
        x = logits / temperature[:, None]
        if any(not g and (0 < p.top_k < vocab or p.top_p < 1.0) for p, g in zip(params, greedy)):
            top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                                 device=device)
            top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=device)
            x = apply_top_k_top_p(x, top_k, top_p)
        if any(not g and p.min_p > 0.0 for p, g in zip(params, greedy)):
            min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=device)
            x = apply_min_p(x, min_p)
        # greedy rows take the argmax elsewhere: their noise (key 0) is never used
        keys = [0 if g else s.noise_key for s, g in zip(states, greedy)]
        return (x + gumbel_noise(keys, vocab, device)).argmax(dim=-1)
