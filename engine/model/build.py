"""The model of a registered architecture (loramux_core/model/archs/), built for one rank:
every registered family runs on the Llama-family model (engine/model/llama.py), its
flags (biases, q/k norms, sliding window, experts) read from the ModelConfig."""
from __future__ import annotations

from loramux_engine.model.llama import LlamaForCausalLM


def build_model(cfg, dtype, device, tp, fused_lora_rank: int = 0):
    """This rank's model for `cfg`, weights not loaded yet (FP8 GEMMs for an FP8
    checkpoint on CUDA). `fused_lora_rank`: spare weight rows for one adapter's LoRA A
    (engine/lora/fused.py), kept only where that path runs: CUDA, one tensor-parallel
    rank, no FP8, no experts."""
    # FP8 checkpoints multiply in FP8 on CUDA; elsewhere they are dequantized at load
    # (the reference path)
    on_cuda = getattr(device, "type", str(device)).startswith("cuda")
    fp8 = cfg.quant == "fp8" and on_cuda
    if not on_cuda or fp8 or tp.size > 1 or cfg.moe is not None:
        fused_lora_rank = 0
    return LlamaForCausalLM(cfg, dtype, device, tp, fp8=fp8, fused_lora_rank=fused_lora_rank)
