"""The model of a registered architecture (loramux_core/model/archs/), built for one rank:
every registered family runs on the Llama-family model (engine/model/llama.py), its
flags (biases, q/k norms, sliding window, experts) read from the ModelConfig."""
from __future__ import annotations

from engine.model.llama import LlamaForCausalLM


def build_model(cfg, dtype, device, tp):
    """This rank's model for `cfg`, weights not loaded yet (FP8 GEMMs for an FP8
    checkpoint on CUDA)."""
    # FP8 checkpoints multiply in FP8 on CUDA; elsewhere they are dequantized at load
    # (the reference path)
    on_cuda = getattr(device, "type", str(device)).startswith("cuda")
    return LlamaForCausalLM(cfg, dtype, device, tp, fp8=cfg.quant == "fp8" and on_cuda)
