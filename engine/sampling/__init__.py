"""Token sampling: per-request state, vectorised logits processors, the batched sampler."""
from loramux_engine.sampling.sampler import (GREEDY_TEMPERATURE, SampledTensors, Sampler,
                                             SamplerOutput)
from loramux_engine.sampling.state import RequestSeeds, SamplingState, mix_seed

__all__ = ["Sampler", "SamplerOutput", "SampledTensors", "SamplingState", "RequestSeeds",
           "mix_seed", "GREEDY_TEMPERATURE"]
