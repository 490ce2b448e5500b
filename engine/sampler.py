"""The sampler's public names, importable as engine.sampler (the code is in engine/sampling/)."""
from engine.sampling import (GREEDY_TEMPERATURE, RequestSeeds, Sampler, SamplerOutput,
                             SamplingState, mix_seed)

__all__ = ["Sampler", "SamplerOutput", "SamplingState", "RequestSeeds", "mix_seed",
           "GREEDY_TEMPERATURE"]
