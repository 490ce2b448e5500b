"""The model registry: one module per architecture, looked up by Hugging Face class name.

Adding an architecture is one file here declaring an `Architecture` (engine/model/archs/
base.py) and one line below.
"""
from __future__ import annotations

from types import MappingProxyType

from engine.model.archs import llama, mistral, qwen2, qwen2_moe, qwen3
from engine.model.archs.base import Architecture, ArchFields, MoeFields
from loramux_core.errors import ModelLoadError

ARCHITECTURES = MappingProxyType({a.hf_name: a for a in (
    llama.ARCH, qwen2.ARCH, qwen3.ARCH, mistral.ARCH, qwen2_moe.ARCH)})


def architecture(cfg) -> Architecture:
    """The registered architecture of a ModelConfig."""
    return ARCHITECTURES[cfg.arch]


def build_model(cfg, dtype, device, tp, max_model_len: int | None = None):
    """This rank's model for `cfg`, weights not loaded yet (FP8 GEMMs for an FP8
    checkpoint on CUDA). Refuses (ModelLoadError) a
    sliding window on CUDA when sequences may be longer than it: the CUDA attention
    kernels do not mask to a window (the CPU path does)."""
    window = cfg.sliding_window
    if getattr(device, "type", str(device)).startswith("cuda") and window is not None \
            and (max_model_len or cfg.max_position_embeddings) > window:
        raise ModelLoadError(
            f"config.json: sliding_window={window}: the CUDA attention kernels do not mask "
            f"to a sliding window; serve with max_model_len <= {window} (now "
            f"{max_model_len or cfg.max_position_embeddings}) or on the CPU")
    # FP8 checkpoints multiply in FP8 on CUDA; elsewhere they are dequantized at load
    # (the reference path)
    on_cuda = getattr(device, "type", str(device)).startswith("cuda")
    return architecture(cfg).build(cfg, dtype, device, tp, fp8=cfg.quant == "fp8" and on_cuda)


__all__ = ["ARCHITECTURES", "Architecture", "ArchFields", "MoeFields", "architecture", "build_model"]
