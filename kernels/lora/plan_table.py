"""The planner's table (kernels/lora/plan.py): which LoRA kernel form runs a call, per GPU.

    (projection group, rank bucket, "one" | "many" adapters)
        -> (form at token buckets 1, 16, 32, 64, 128, 256), the measurement that chose them

A GPU run regenerates a GPU's rows: `python -m benchmarks.kernels lora --planner --out D`
times every form on every cell and writes D/plan_table.py in this layout, naming itself
(benchmarks/results/<run>/plan.csv once kept there): paste its rows under the GPU's key.
Above 256 tokens only the tile-list form exists (plan.TOKEN_PATH_MAX_TOKENS).

A row without a measurement at its rank says NOT_MEASURED and was derived by rule: the
rank-16 measurement's forms (the H100's many-adapter rows but rank 16 and qkv at 128).
The grid of 2026-12-07 moved one adapter from rank 32 up off the token kernels from 32-64
tokens: they re-read the adapter's A and B for every token, so their work grows with
tokens x rank (on an H100 against vLLM's kernels: rank 128 gate_up at 256 tokens 591 us
against 69, rank 64 gate_up 295 against 54), where a tile of rows reads it once.
"""
from __future__ import annotations

NOT_MEASURED = "not yet measured"
# 64 adapters round robin, rank 16, bf16, Llama-3-8B groups, one H100 80GB HBM3
# (NOTES "Performance round 3 and thousands of adapters", "Mixed decode above 64 tokens");
# the H200 took them unchanged (2026-11-27-h200/kernels.csv, decode_before_after.json)
R16_MANY = "2026-11-25-h100/kernels.csv"
# every form on every cell, one H100 80GB HBM3, 2026-12-07: the one-adapter rows at every
# rank and ("qkv", 128, "many") before the run's time budget ran out
# (python -m benchmarks.kernels lora --planner --budget 170)
H100_GRID = "2026-12-07-h100-plan/plan.csv"

TOKEN_BUCKETS = (1, 16, 32, 64, 128, 256)
RANK_BUCKETS = (8, 16, 32, 64, 128)

H100 = {
    ("qkv", 8, "one"): (("tokens", "tokens", "tokens", "tokens", "tokens", "tokens"), H100_GRID),
    ("qkv", 8, "many"): (("tokens", "tokens", "tokens", "tokens", "mixed", "mixed"), NOT_MEASURED),
    ("qkv", 16, "one"): (("tokens", "tokens", "tokens", "tokens", "tokens", "tokens"), H100_GRID),
    ("qkv", 16, "many"): (("tokens", "tokens", "tokens", "tokens", "mixed", "mixed"), R16_MANY),
    ("qkv", 32, "one"): (("tokens", "tokens", "tokens", "mixed", "tiles", "tiles"), H100_GRID),
    ("qkv", 32, "many"): (("tokens", "tokens", "tokens", "tokens", "mixed", "mixed"), NOT_MEASURED),
    ("qkv", 64, "one"): (("tokens", "tokens", "tokens", "mixed", "tiles", "tiles"), H100_GRID),
    ("qkv", 64, "many"): (("tokens", "tokens", "tokens", "tokens", "mixed", "mixed"), NOT_MEASURED),
    ("qkv", 128, "one"): (("tokens", "tokens", "tiles", "mixed", "tiles", "tiles"), H100_GRID),
    ("qkv", 128, "many"): (("tokens", "tiles", "tiles", "tiles", "tiles", "tiles"), H100_GRID),
    ("o", 8, "one"): (("tokens", "tokens", "tokens", "tokens", "tokens", "tokens"), H100_GRID),
    ("o", 8, "many"): (("tokens", "tokens", "tokens", "tokens", "mixed", "mixed"), NOT_MEASURED),
    ("o", 16, "one"): (("tokens", "tokens", "tokens", "tokens", "tokens", "tokens"), H100_GRID),
    ("o", 16, "many"): (("tokens", "tokens", "tokens", "tokens", "mixed", "mixed"), R16_MANY),
    ("o", 32, "one"): (("tokens", "tokens", "tokens", "tokens", "tokens", "tiles"), H100_GRID),
    ("o", 32, "many"): (("tokens", "tokens", "tokens", "tokens", "mixed", "mixed"), NOT_MEASURED),
    ("o", 64, "one"): (("tokens", "tokens", "tokens", "mixed", "mixed", "tiles"), H100_GRID),
    ("o", 64, "many"): (("tokens", "tokens", "tokens", "tokens", "mixed", "mixed"), NOT_MEASURED),
    ("o", 128, "one"): (("tokens", "tokens", "tokens", "mixed", "mixed", "tiles"), H100_GRID),
    ("o", 128, "many"): (("tokens", "tokens", "tokens", "tokens", "mixed", "mixed"), NOT_MEASURED),
    ("gate_up", 8, "one"): (("tokens", "tokens", "tokens", "tokens", "tokens", "tiles"), H100_GRID),
    ("gate_up", 8, "many"): (("tokens", "tokens", "tokens", "tokens", "mixed", "mixed"), NOT_MEASURED),
    ("gate_up", 16, "one"): (("tokens", "tokens", "tokens", "tokens", "tokens", "tiles"), H100_GRID),
    ("gate_up", 16, "many"): (("tokens", "tokens", "tokens", "tokens", "mixed", "mixed"), R16_MANY),
    ("gate_up", 32, "one"): (("tokens", "tokens", "tokens", "mixed", "tiles", "tiles"), H100_GRID),
    ("gate_up", 32, "many"): (("tokens", "tokens", "tokens", "tokens", "mixed", "mixed"), NOT_MEASURED),
    ("gate_up", 64, "one"): (("tokens", "tokens", "tokens", "tiles", "tiles", "tiles"), H100_GRID),
    ("gate_up", 64, "many"): (("tokens", "tokens", "tokens", "tokens", "mixed", "mixed"), NOT_MEASURED),
    ("gate_up", 128, "one"): (("tokens", "tokens", "tiles", "tiles", "tiles", "tiles"), H100_GRID),
    ("gate_up", 128, "many"): (("tokens", "tokens", "tokens", "tokens", "mixed", "mixed"), NOT_MEASURED),
    ("down", 8, "one"): (("tokens", "tokens", "tokens", "tokens", "tokens", "tokens"), H100_GRID),
    ("down", 8, "many"): (("tokens", "tokens", "tokens", "tokens", "mixed", "mixed"), NOT_MEASURED),
    ("down", 16, "one"): (("tokens", "tokens", "tokens", "tokens", "tokens", "tokens"), H100_GRID),
    ("down", 16, "many"): (("tokens", "tokens", "tokens", "tokens", "mixed", "mixed"), R16_MANY),
    ("down", 32, "one"): (("tokens", "tokens", "tokens", "tokens", "tokens", "tiles"), H100_GRID),
    ("down", 32, "many"): (("tokens", "tokens", "tokens", "tokens", "mixed", "mixed"), NOT_MEASURED),
    ("down", 64, "one"): (("tokens", "tokens", "tokens", "mixed", "tiles", "tiles"), H100_GRID),
    ("down", 64, "many"): (("tokens", "tokens", "tokens", "tokens", "mixed", "mixed"), NOT_MEASURED),
    ("down", 128, "one"): (("tokens", "tokens", "mixed", "mixed", "tiles", "tiles"), H100_GRID),
    ("down", 128, "many"): (("tokens", "tokens", "tokens", "tokens", "mixed", "mixed"), NOT_MEASURED),
}

# GPU key (a substring of the device name) -> rows. The H200 has the H100's SMs and more
# bandwidth: it takes the H100's rows until its own run (plan.py _FALLBACK).
TABLE = {"H100": H100}
