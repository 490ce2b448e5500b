"""Mistral (MistralForCausalLM): no biases; when config.json sets `sliding_window`, every
layer attends to the last `sliding_window` positions only (transformers' mask: key
position > query position - sliding_window)."""
from loramux_core.model.archs.base import Architecture, ArchFields
from loramux_core.model.archs.llama import DECODER_TARGETS
from loramux_core.errors import ModelLoadError


def _fields(raw: dict) -> ArchFields:
    window = raw.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ModelLoadError(f"config.json: sliding_window={window!r} must be a positive "
                             f"integer or null")
    return ArchFields(sliding_window=window)


ARCH = Architecture("MistralForCausalLM", _fields, DECODER_TARGETS)  # Llama's layer layout
