"""loramux engine: the data plane (model, paged KV cache, scheduler, adapter slots)."""
from engine.config import EngineConfig
from engine.engine import Engine
from engine.outputs import FinishReason, RequestOutput, StepOutput
from loramux_core.errors import (AdapterError, AdapterNotFoundError, AdapterUnavailableError,
                                 CapacityError, EngineDeadError, InvalidRequestError, LoramuxError,
                                 ModelLoadError, PromptTooLongError)
from loramux_core.sampling import SamplingParams

__all__ = [
    "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "StepOutput", "FinishReason",
    "LoramuxError", "InvalidRequestError", "PromptTooLongError", "ModelLoadError",
    "AdapterError", "AdapterNotFoundError", "AdapterUnavailableError", "CapacityError",
    "EngineDeadError",
]
