"""Qwen3 (Qwen3ForCausalLM): RMSNorm over each query and key head (q_norm, k_norm)
between the projection and rotary; `attention_bias` gives q, k, v and o biases; full
attention only."""
from loramux_core.model.archs.base import Architecture, ArchFields, refuse_sliding_window
from loramux_core.model.archs.llama import DECODER_TARGETS


def _fields(raw: dict) -> ArchFields:
    refuse_sliding_window(raw)
    bias = bool(raw.get("attention_bias", False))
    return ArchFields(qkv_bias=bias, o_bias=bias, qk_norm=True)


ARCH = Architecture("Qwen3ForCausalLM", _fields, DECODER_TARGETS)  # Llama's layer layout
