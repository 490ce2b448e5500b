"""Conversions from the engine's own outputs to the wire messages (loramux_core.v1). The
conversions of contract types (sampling parameters, errors) live in loramux_core."""
from __future__ import annotations

from loramux.v1 import generate_pb2

from loramux_engine.outputs import FinishReason, StepOutput
from loramux_core.v1 import engine_pb2

_FINISH = {
    FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
    FinishReason.EOS: generate_pb2.FINISH_REASON_EOS,
    FinishReason.ABORTED: generate_pb2.FINISH_REASON_ABORTED,
    FinishReason.ERROR: generate_pb2.FINISH_REASON_ERROR,
}


def delta_to_proto(out: StepOutput) -> engine_pb2.RequestDelta:
    """One request's share of a step, for the StepBatch."""
    d = engine_pb2.RequestDelta(
        request_id=out.request_id, token_ids=out.new_token_ids, text=out.text_delta,
        finished=out.finished, prompt_tokens=out.num_prompt_tokens,
        cached_tokens=out.num_cached_tokens)
    if out.finished:
        d.finish_reason = _FINISH.get(out.finish_reason, generate_pb2.FINISH_REASON_ERROR)
    for i, lp in enumerate(out.new_logprobs):
        entry = d.logprobs.add(logprob=lp)
        if i < len(out.new_top_logprobs):
            for tid, tlp in out.new_top_logprobs[i].items():
                entry.top.add(token_id=tid, logprob=tlp)
    return d
