"""Per-request sampling state and the seeds that make sampling reproducible.

Randomness is keyed, not streamed: the noise of a request's step t (the position of the
token in its output) comes from mix(seed, sample_index, t) alone (sampling/noise.py). So a
seeded request draws the same tokens whatever else is in the batch, wherever it sits in
it, if a step is recomputed, and when it is resumed on another engine after t tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from loramux_core.sampling import SamplingParams


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*parts: int) -> int:
    """A well-spread 63-bit seed from integers (splitmix64 chain): nearby inputs such as
    consecutive steps give unrelated seeds."""
    h = 0
    for p in parts:
        h = _splitmix64(h ^ (int(p) & _MASK64))
    return h >> 1


class RequestSeeds:
    """Seeds for requests that carry none: derived from the engine's base seed and a
    request counter, so one engine run is reproducible end to end. One per engine."""

    def __init__(self, base_seed: int):
        self._base = int(base_seed)
        self._count = 0

    def next(self) -> int:
        self._count += 1
        return mix_seed(self._base, self._count)


@dataclass(eq=False)
class SamplingState:
    """What the sampler needs to know about one request (one sequence of it when n > 1).

    The engine creates one per sequence with `create` and calls `append` with each token
    it keeps (or appends to `output_token_ids` directly: `seen_token_ids` catches up)."""
    params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    seed: int
    sample_index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    _seen: set[int] = field(default_factory=set, init=False, repr=False)
    _seen_upto: int = field(default=-1, init=False, repr=False)

    @classmethod
    def create(cls, params: SamplingParams, prompt_token_ids, *, default_seed: int,
               sample_index: int = 0) -> "SamplingState":
        """State for a new sequence. `default_seed` (e.g. RequestSeeds.next()) is used
        when params.seed is None; `sample_index` tells apart the n sequences of a request."""
        seed = params.seed if params.seed is not None else default_seed
        return cls(params=params, prompt_token_ids=tuple(prompt_token_ids), seed=int(seed),
                   sample_index=sample_index)

    @property
    def step(self) -> int:
        """Index of the token the next sample() call draws (0 = first generated token)."""
        return len(self.output_token_ids)

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(int(token_id))

    def seen_token_ids(self) -> set[int]:
        """Distinct ids of prompt and output so far (what repetition_penalty punishes)."""
        if self._seen_upto < 0:
            self._seen.update(self.prompt_token_ids)
            self._seen_upto = 0
        if self._seen_upto < len(self.output_token_ids):
            self._seen.update(self.output_token_ids[self._seen_upto:])
            self._seen_upto = len(self.output_token_ids)
        return self._seen

    @property
    def noise_key(self) -> int:
        """The key of the noise the next sample() call draws (see sampling/noise.py)."""
        return mix_seed(self.seed, self.sample_index, self.step)
