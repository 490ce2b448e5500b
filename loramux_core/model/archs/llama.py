"""Llama (LlamaForCausalLM): `attention_bias` gives q, k, v and o biases.

Its decoder layer is the layout the other Llama-family modules here share: seven
projections, run as four merged groups (loramux_core/model/lora_targets.py says what a group
is), named in checkpoints `model.layers.{i}.{parent}.{module}`.
"""
from loramux_core.model.archs.base import Architecture, ArchFields, LoraTarget

# The seven projections of a decoder layer, in group and slice order.
DECODER_TARGETS: tuple[LoraTarget, ...] = (
    LoraTarget("q_proj", "self_attn", "qkv", 0, "column", ("hidden", "q")),
    LoraTarget("k_proj", "self_attn", "qkv", 1, "column", ("hidden", "kv")),
    LoraTarget("v_proj", "self_attn", "qkv", 2, "column", ("hidden", "kv")),
    LoraTarget("o_proj", "self_attn", "o", 0, "row", ("q", "hidden")),
    LoraTarget("gate_proj", "mlp", "gate_up", 0, "column", ("hidden", "inter")),
    LoraTarget("up_proj", "mlp", "gate_up", 1, "column", ("hidden", "inter")),
    LoraTarget("down_proj", "mlp", "down", 0, "row", ("inter", "hidden")),
)


def _fields(raw: dict) -> ArchFields:
    bias = bool(raw.get("attention_bias", False))
    return ArchFields(qkv_bias=bias, o_bias=bias)


ARCH = Architecture("LlamaForCausalLM", _fields, DECODER_TARGETS)
