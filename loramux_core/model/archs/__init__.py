"""The model registry: one module per architecture, looked up by Hugging Face class name.

Adding an architecture is one file here declaring an `Architecture` (loramux_core/model/archs/
base.py) and one line below. Declarations only, torch-free (the control plane and the
gateway read them); the engine builds the model (engine/model/build.py).
"""
from __future__ import annotations

from types import MappingProxyType

from loramux_core.model.archs import llama, mistral, qwen2, qwen2_moe, qwen3
from loramux_core.model.archs.base import Architecture, ArchFields, MoeFields

ARCHITECTURES = MappingProxyType({a.hf_name: a for a in (
    llama.ARCH, qwen2.ARCH, qwen3.ARCH, mistral.ARCH, qwen2_moe.ARCH)})


def architecture(cfg) -> Architecture:
    """The registered architecture of a ModelConfig."""
    return ARCHITECTURES[cfg.arch]


__all__ = ["ARCHITECTURES", "Architecture", "ArchFields", "MoeFields", "architecture"]
