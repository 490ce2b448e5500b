"""loramux engine: the data plane (model, paged KV cache, scheduler, adapter slots)."""
from engine.config import EngineConfig
from engine.errors import (AdapterError, AdapterNotFoundError, AdapterUnavailableError,
                           CapacityError, InvalidRequestError, LoramuxError, ModelLoadError,
                           PromptTooLongError)
from engine.outputs import FinishReason, RequestOutput, StepOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "EngineConfig", "SamplingParams", "RequestOutput", "StepOutput", "FinishReason",
    "LoramuxError", "InvalidRequestError", "PromptTooLongError", "ModelLoadError",
    "AdapterError", "AdapterNotFoundError", "AdapterUnavailableError", "CapacityError",
]

try:  # the Engine lands with the runner; the parts above are usable without it
    from engine.engine import Engine  # noqa: F401
    __all__.append("Engine")
except ImportError:  # pragma: no cover
    pass
