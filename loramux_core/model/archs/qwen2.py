"""Qwen2 (Qwen2ForCausalLM): q/k/v biases always, no o bias; full attention only."""
from loramux_core.model.archs.base import Architecture, ArchFields, refuse_sliding_window
from loramux_core.model.archs.llama import DECODER_TARGETS


def _fields(raw: dict) -> ArchFields:
    refuse_sliding_window(raw)
    return ArchFields(qkv_bias=True)


ARCH = Architecture("Qwen2ForCausalLM", _fields, DECODER_TARGETS)  # Llama's layer layout
