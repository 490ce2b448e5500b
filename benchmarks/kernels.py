"""The LoRA and decode-path kernels on Llama-3-8B shapes against their memory floor, timed
in CUDA graphs: `python -m benchmarks.kernels [CASE] --out DIR [options]`
(benchmarks/suite.py). CUDA only.

    lora         shrink + expand per layer group at the target points (--targets), the
                 uniform (--uniform) and prefill (--prefill) grids, or all (--quick);
                 --planner: every form on the planner's grid, and the table rows it
                 gives (benchmarks/plan_grid.py; --tiny: the CPU)
    sweep-mixed  the mixed-adapter kernels' launch parameters (--budget SECONDS)
    peers        ours beside vLLM's and SGLang's Triton LoRA kernels, same shapes and run
                 (their sources: python -m benchmarks.peer_sources fetch; --tiny: the CPU)
"""
from __future__ import annotations

import sys

from benchmarks.suite import Case, main

CASES = {
    "lora": Case("benchmarks.bench_kernels", "multi-adapter LoRA kernels vs the floor",
                 tiny=("--planner", "--tiny")),
    "sweep-mixed": Case("benchmarks.sweep_lora_mixed", "mixed-adapter launch parameters"),
    "peers": Case("benchmarks.bench_peers", "LoRA kernels vs vLLM's and SGLang's",
                  tiny=("--tiny",)),
}

if __name__ == "__main__":
    sys.exit(main("kernels", CASES))
