"""FP8 copies of a tiny model, as common FP8 checkpoints store them: every attention and
MLP projection weight (and every expert's) in float8_e4m3fn with a float32 `weight_scale`
per tensor or per output channel, `quantization_config: {quant_method: fp8}` in
config.json; and the same model dequantized (W_fp8 · scale in float32), which transformers
loads as the reference."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from loramux_kernels.fp8 import FP8, FP8_MAX

_QUANTIZED = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")


def quantize(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8, scale) with scale [out, 1] per channel or [] per tensor."""
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    scale = (amax.float() / FP8_MAX).clamp(min=1e-12)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def make_fp8_pair(model_dir: Path, fp8_dir: Path, dequant_dir: Path,
                  per_channel: bool) -> tuple[Path, Path]:
    """Write the FP8 checkpoint of `model_dir` at `fp8_dir` and its dequantized float32
    twin at `dequant_dir` (both with the same tokenizer and generation config)."""
    tensors = load_file(model_dir / "model.safetensors")
    fp8, dense = {}, {}
    for name, w in tensors.items():
        if _QUANTIZED.search(name):
            q, s = quantize(w, per_channel)
            fp8[name], fp8[name.removesuffix("weight") + "weight_scale"] = q, s
            dense[name] = q.float() * s
        else:
            fp8[name] = dense[name] = w
    for out, weights, quantized in ((fp8_dir, fp8, True), (dequant_dir, dense, False)):
        shutil.copytree(model_dir, out)
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        if quantized:
            cfg = json.loads((out / "config.json").read_text())
            cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
            (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return fp8_dir, dequant_dir
