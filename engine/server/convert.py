"""Conversions between the wire messages (loramux.v1) and the engine's own types."""
from __future__ import annotations

from loramux.v1 import engine_pb2, generate_pb2

from engine.errors import (AdapterChangedError, AdapterError, AdapterNotFoundError,
                           AdapterPathError, AdapterUnavailableError, CapacityError,
                           EngineDeadError, InvalidRequestError, LoramuxError)
from engine.outputs import FinishReason, StepOutput
from engine.sampling_params import SamplingParams

_FINISH = {
    FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
    FinishReason.EOS: generate_pb2.FINISH_REASON_EOS,
    FinishReason.ABORTED: generate_pb2.FINISH_REASON_ABORTED,
    FinishReason.ERROR: generate_pb2.FINISH_REASON_ERROR,
}
_SCALARS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "max_tokens")


def sampling_from_proto(pb: generate_pb2.SamplingParams) -> SamplingParams:
    """Engine SamplingParams from the wire message; unset optional fields keep the engine
    defaults. Raises InvalidRequestError for values out of range is left to validate()."""
    kwargs = {name: getattr(pb, name) for name in _SCALARS if pb.HasField(name)}
    return SamplingParams(
        **kwargs, stop=tuple(pb.stop), stop_token_ids=tuple(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos, logprobs=pb.logprobs, top_logprobs=pb.top_logprobs,
        include_stop_str_in_output=pb.include_stop_str_in_output)


def error_code(exc: BaseException) -> int:
    """The gRPC status number (engine_pb2.ErrorCode) a typed engine error maps to."""
    if isinstance(exc, AdapterNotFoundError):
        return engine_pb2.ERROR_CODE_NOT_FOUND
    if isinstance(exc, AdapterPathError):
        return engine_pb2.ERROR_CODE_PERMISSION_DENIED
    if isinstance(exc, AdapterChangedError):
        return engine_pb2.ERROR_CODE_FAILED_PRECONDITION
    if isinstance(exc, (InvalidRequestError, AdapterError)):
        return engine_pb2.ERROR_CODE_INVALID_ARGUMENT
    if isinstance(exc, CapacityError):
        return engine_pb2.ERROR_CODE_RESOURCE_EXHAUSTED
    if isinstance(exc, EngineDeadError):
        return engine_pb2.ERROR_CODE_UNAVAILABLE
    if isinstance(exc, (AdapterUnavailableError, LoramuxError)):
        return engine_pb2.ERROR_CODE_FAILED_PRECONDITION
    return engine_pb2.ERROR_CODE_INTERNAL


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
