"""The model of a registered architecture (loramux_core/model/archs/), built for one rank:
every registered family runs on the Llama-family model (engine/model/llama.py), its
flags (biases, q/k norms, sliding window, experts) read from the ModelConfig."""
from __future__ import annotations

from engine.model.llama import LlamaForCausalLM
from loramux_core.errors import ModelLoadError


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
    return LlamaForCausalLM(cfg, dtype, device, tp, fp8=cfg.quant == "fp8" and on_cuda)
