"""Llama (LlamaForCausalLM): `attention_bias` gives q, k, v and o biases."""
from engine.model.archs.base import Architecture, ArchFields


def _fields(raw: dict) -> ArchFields:
    bias = bool(raw.get("attention_bias", False))
    return ArchFields(qkv_bias=bias, o_bias=bias)


ARCH = Architecture("LlamaForCausalLM", _fields)
