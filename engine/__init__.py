"""loramux engine: the data plane (model, paged KV cache, scheduler, adapter slots)."""
from engine.lazy import lazy_exports
from loramux_core.errors import (AdapterError, AdapterNotFoundError, AdapterUnavailableError,
                                 CapacityError, EngineDeadError, InvalidRequestError, LoramuxError,
                                 ModelLoadError, PromptTooLongError)
from loramux_core.sampling import SamplingParams

_TORCH_EXPORTS = {"Engine": "engine.engine", "EngineConfig": "engine.config",
                  "FinishReason": "engine.outputs", "RequestOutput": "engine.outputs",
                  "StepOutput": "engine.outputs"}
__getattr__ = lazy_exports(__name__, _TORCH_EXPORTS)

__all__ = [
    "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "StepOutput", "FinishReason",
    "LoramuxError", "InvalidRequestError", "PromptTooLongError", "ModelLoadError",
    "AdapterError", "AdapterNotFoundError", "AdapterUnavailableError", "CapacityError",
    "EngineDeadError",
]
