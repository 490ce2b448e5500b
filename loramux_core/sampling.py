"""Per-request sampling parameters. Field names match the public Generate API."""
from __future__ import annotations

from dataclasses import dataclass

from loramux.v1 import generate_pb2

from loramux_core.errors import InvalidRequestError
from loramux_core.structured import StructuredOutput, structured_from_proto


MAX_TOP_LOGPROBS = 20
# Temperatures below this sample greedily: dividing logits by them overflows float32.
GREEDY_TEMPERATURE = 1e-5
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty")
_INT_FIELDS = ("top_k", "max_tokens", "top_logprobs", "n")
_BOOL_FIELDS = ("ignore_eos", "logprobs", "include_stop_str_in_output")
_SCALARS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "max_tokens")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None   # constrained decoding (None: free text)

    def __post_init__(self):
        # Accept lists from callers; keep the dataclass hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first field out of range."""
        def bad(name: str, why: str):
            raise InvalidRequestError(f"sampling.{name}={getattr(self, name)!r}: {why}")

        self._validate_types(bad)
        if not (self.temperature >= 0.0) or self.temperature > 100.0:
            bad("temperature", "must be in [0, 100]")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            bad("top_k", "must be >= 0 (0 disables it)")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", "must be in [0, 1]")
        if not (0.0 < self.repetition_penalty <= 10.0):
            bad("repetition_penalty", "must be in (0, 10]")
        if self.max_tokens < 1:
            bad("max_tokens", "must be >= 1")
        if not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            bad("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.n < 1 or self.n > 64:
            bad("n", "must be in [1, 64]")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            bad("seed", "must be in [0, 2**63)")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            bad("stop", "stop strings must be non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "every id must be an integer >= 0")
        if vocab_size is not None and any(not (0 <= t < vocab_size) for t in self.stop_token_ids):
            bad("stop_token_ids", f"every id must be in [0, {vocab_size})")
        if self.structured is not None:
            self.structured.validate()

    def _validate_types(self, bad) -> None:
        """Wrong types get a field-named error instead of a TypeError deep in the sampler."""
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                bad(name, "must be a number")
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                bad(name, "must be an integer")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad("seed", "must be an integer or None")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")


def sampling_from_proto(pb: generate_pb2.SamplingParams) -> SamplingParams:
    """SamplingParams from the wire message; unset optional fields keep the defaults.
    Values out of range are left to validate()."""
    kwargs = {name: getattr(pb, name) for name in _SCALARS if pb.HasField(name)}
    return SamplingParams(
        **kwargs, stop=tuple(pb.stop), stop_token_ids=tuple(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos, logprobs=pb.logprobs, top_logprobs=pb.top_logprobs,
        include_stop_str_in_output=pb.include_stop_str_in_output,
        structured=structured_from_proto(pb.structured) if pb.HasField("structured") else None)
