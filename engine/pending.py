"""The sampled tokens of a launched step, before the host has read them.

A `PendingSample` keeps the step's sampled token ids on the device (`tokens`, what the
next step's placeholder inputs gather from) and starts copying everything the host needs
into pinned memory without blocking; `result()` waits for that copy only. On the CPU the
copies are plain reads. With async scheduling the engine launches step N+1 between a
step N's launch and its `result()`, so the host work of N+1 overlaps N on the device.
"""
from __future__ import annotations

from typing import Callable

import torch

from loramux_engine.request import Request
from loramux_engine.sampling import SampledTensors
from loramux_engine.scheduler import Sampled

Decode = Callable[..., dict[str, Sampled]]


class PendingSample:
    def __init__(self, requests: list[Request], tokens: torch.Tensor | None,
                 tensors: tuple[torch.Tensor | None, ...], decode: Decode):
        """`requests`: the sampling rows in order; `tokens`: their [S] int64 token ids on
        the device; `tensors` are copied to the host and passed to `decode(requests,
        *host_tensors)`, which builds the request id -> Sampled map."""
        self.requests = requests
        self.tokens = tokens
        self.needs_history = False  # a row's sampler reads the token history (runner sets)
        # the tokens are the greedy pick of logits every tensor-parallel rank holds: every
        # rank has them on its device (runner sets; async scheduling at TP needs it)
        self.tokens_on_every_rank = False
        self._decode = decode
        self._event = None
        if tokens is not None and tokens.device.type == "cuda":
            self._host = tuple(None if t is None else _to_pinned(t) for t in tensors)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensors
        self._result: dict[str, Sampled] | None = None

    @classmethod
    def known(cls, sampled: dict[str, Sampled], requests: list[Request],
              device: torch.device) -> "PendingSample":
        """A step whose tokens are already on the host (sync sampling paths)."""
        tokens = torch.tensor([sampled[r.request_id].token_id for r in requests],
                              dtype=torch.int64)
        if device.type == "cuda":
            tokens = tokens.pin_memory().to(device, non_blocking=True)
        pending = cls(requests, tokens, (), lambda _reqs: sampled)
        pending._result = sampled
        return pending

    @classmethod
    def of_sampler(cls, requests: list[Request], res: SampledTensors) -> "PendingSample":
        return cls(requests, res.token_ids,
                   (res.token_ids, res.logprobs, res.top_values, res.top_ids),
                   lambda reqs, *t: _decode_sampler(reqs, res.top_wanted, *t))

    @classmethod
    def of_greedy_graph(cls, requests: list[Request], picked: torch.Tensor) -> "PendingSample":
        """`picked`: the greedy graph's [2, n] (token id, logprob) float64 output; copied
        out before the next replay overwrites it (stream order)."""
        return cls(requests, picked[0].long(), (picked,), _decode_greedy)

    @classmethod
    def device_only(cls, requests: list[Request], tokens: torch.Tensor) -> "PendingSample":
        """A tensor-parallel worker's step: the picked tokens stay on the device for the
        next step's placeholders; the host never reads them (`result()` is empty)."""
        pending = cls(requests, tokens, (), lambda _reqs: {})
        pending._result = {}
        return pending

    def result(self) -> dict[str, Sampled]:
        """Wait for the copies (the step's only host sync) and return the tokens."""
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            self._result = self._decode(self.requests, *self._host)
        return self._result


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def _decode_sampler(requests, wanted, token_ids, logprobs, top_values, top_ids):
    out = SampledTensors(token_ids, logprobs, top_values, top_ids, wanted).to_output()
    return {r.request_id: Sampled(tok, lp, top)
            for r, tok, lp, top in zip(requests, out.token_ids, out.logprobs, out.top_logprobs)}


def _decode_greedy(requests, picked):
    toks, lps = picked.tolist()
    return {r.request_id: Sampled(int(tok), lp, None) for r, tok, lp in zip(requests, toks, lps)}
