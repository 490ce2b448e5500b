"""loramux engine: the data plane (model, paged KV cache, scheduler, adapter slots)."""
if __name__ != "loramux_engine":   # engine/ found through a path entry: one name a module
    raise ImportError(f"engine/ installs as loramux_engine, not as {__name__}")

from loramux_engine.lazy import lazy_exports
from loramux_core.errors import (AdapterError, AdapterNotFoundError, AdapterUnavailableError,
                                 CapacityError, EngineDeadError, InvalidRequestError, LoramuxError,
                                 ModelLoadError, PromptTooLongError)
from loramux_core.sampling import SamplingParams

_TORCH_EXPORTS = {"Engine": "loramux_engine.engine", "EngineConfig": "loramux_engine.config",
                  "FinishReason": "loramux_engine.outputs",
                  "RequestOutput": "loramux_engine.outputs",
                  "StepOutput": "loramux_engine.outputs"}
__getattr__ = lazy_exports(__name__, _TORCH_EXPORTS)

__all__ = [
    "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "StepOutput", "FinishReason",
    "LoramuxError", "InvalidRequestError", "PromptTooLongError", "ModelLoadError",
    "AdapterError", "AdapterNotFoundError", "AdapterUnavailableError", "CapacityError",
    "EngineDeadError",
]
