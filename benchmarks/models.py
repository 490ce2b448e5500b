"""Other model kinds: `python -m benchmarks.models [CASE] --out DIR [options]`
(benchmarks/suite.py). CUDA only.

    moe  the MoE layer on Qwen1.5-MoE-A2.7B shapes (Triton grouped GEMM, expert LoRA)
         against transformers' expert loop, then the whole model through the engine
    fp8  FP8 base weights against bf16 on Llama-3-8B shapes: GEMMs, then the whole model
"""
from __future__ import annotations

import sys

from benchmarks.suite import Case, main

CASES = {
    "moe": Case("benchmarks.bench_moe", "MoE layer and model, with expert LoRA"),
    "fp8": Case("benchmarks.bench_fp8", "FP8 weights against bf16: accuracy and speed"),
}

if __name__ == "__main__":
    sys.exit(main("models", CASES))
