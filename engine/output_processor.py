"""From sampled tokens to what the caller sees: text, logprobs, and every stop check.

The scheduler appends a sampled token to its request and nothing more. The output
processor takes it from there: it keeps each request's `OutputState` (the incremental
detokenizer, the text so far, the logprobs, how much of the text was handed out),
decides whether the request stops (a stop token id, EOS, max_tokens, max_model_len, a
stop string), and builds the StepOutput and RequestOutput records. The engine finishes a
request in the scheduler when `append` returns a finish reason.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from loramux_engine.detokenizer import IncrementalDetokenizer
from loramux_engine.outputs import FinishReason, RequestOutput, StepOutput
from loramux_engine.request import Request
from loramux_engine.scheduler import Sampled


@dataclass
class OutputState:
    """What one request has produced for its caller (the processor's, on `Request.output`)."""
    detokenizer: IncrementalDetokenizer
    # The pieces of text the detokenizer handed out since the last StepOutput (its `text`
    # holds all of them; appending each piece to one string here would copy the whole text
    # per token, quadratic in a long generation).
    unsent: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)

    @property
    def text(self) -> str:
        """All text so far."""
        return self.detokenizer.text

    def add_text(self, piece: str) -> None:
        if piece:
            self.unsent.append(piece)

    def take_unsent(self) -> str:
        """The text not yet in a StepOutput, from now on counted as sent."""
        new = "".join(self.unsent)
        self.unsent.clear()
        return new


def token_stop(req: Request, eos_token_ids: frozenset[int], max_model_len: int) -> str | None:
    """The finish reason after the request's last token, from token ids alone, or None."""
    last, params = req.all_token_ids[-1], req.params
    if last in params.stop_token_ids:
        return FinishReason.STOP
    if not params.ignore_eos and last in eos_token_ids:
        return FinishReason.EOS
    if req.num_output_tokens >= params.max_tokens or req.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: frozenset[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def add(self, req: Request) -> None:
        """Start the request's output (before it is scheduled)."""
        p = req.params
        req.output = OutputState(IncrementalDetokenizer(
            self.tokenizer, req.prompt_token_ids, skip_special_tokens=True, stop=p.stop,
            include_stop_str_in_output=p.include_stop_str_in_output))
        self._replay(req)

    @staticmethod
    def _replay(req: Request) -> None:
        """A resumed request starts with tokens its caller already has: they go through
        the detokenizer one at a time, as they did on their first run, so its state (the
        text held back for a stop string, a character still incomplete) is what it was
        there, and only what follows is sent. Their logprobs were sent with them (NaN
        here)."""
        out = req.output
        for token in req.output_token_ids:
            out.detokenizer.push([token])
            out.logprobs.append(math.nan)

    def append(self, req: Request, sampled: Sampled) -> str | None:
        """Record the token the scheduler just appended to `req`; returns the reason the
        request finishes with it, or None."""
        out = req.output
        out.logprobs.append(sampled.logprob)
        if sampled.top_logprobs is not None:
            out.top_logprobs.append(sampled.top_logprobs)
        reason = token_stop(req, self.eos_token_ids, self.max_model_len)
        out.add_text(out.detokenizer.push(req.all_token_ids[-1:]))
        if out.detokenizer.stop_hit:
            reason = FinishReason.STOP
        if reason is not None:
            out.add_text(out.detokenizer.finish())  # release text held back for stop strings
        return reason

    @staticmethod
    def step_output(req: Request, new_token: bool = True) -> StepOutput:
        """What the caller has not seen yet: the newest token (unless `new_token` is
        False, e.g. a request that ends without one) and the text since the last call."""
        out, p = req.output, req.params
        delta = out.take_unsent()
        return StepOutput(
            request_id=req.request_id,
            new_token_ids=[req.all_token_ids[-1]] if new_token else [],
            new_logprobs=[out.logprobs[-1]] if new_token and (p.logprobs or p.top_logprobs)
            else [],
            new_top_logprobs=[out.top_logprobs[-1]] if new_token and p.top_logprobs else [],
            text_delta=delta, finished=req.is_finished, finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens)

    @staticmethod
    def request_output(req: Request) -> RequestOutput:
        """The whole result of a finished request (Engine.generate)."""
        out = req.output
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids),
            token_ids=req.output_token_ids, text=out.text, finish_reason=req.finish_reason,
            logprobs=list(out.logprobs), top_logprobs=list(out.top_logprobs),
            num_cached_tokens=req.num_cached_tokens, adapter_id=req.adapter_id)
