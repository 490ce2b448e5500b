"""Decode and prefill of the engine on the Llama-3-8B shape (random bf16 weights, nothing
downloaded): `python -m benchmarks.decode [CASE] --out DIR [options]` (benchmarks/suite.py).

    decode   steps per second at each batch, base / one adapter / distinct adapters,
             against the memory floor and HF + PEFT in the same run
             (--steps 16 --batches 1,16,64,256 [--no-hf] [--profile-batches 64,256] ...)
    prefill  end-to-end prefill tokens/s: base, one adapter, 64 adapters (--tiny: 2 layers
             on the CPU)
    structured  decode step at batch 64, 64 adapters, 0/25/100% of rows under a JSON
             schema; grammar compile p50/p99 over real schemas, 128k vocabulary (--tiny)
"""
from __future__ import annotations

import sys

from benchmarks.suite import Case, main

CASES = {
    "decode": Case("benchmarks.bench_decode", "engine decode vs the memory floor and HF + PEFT"),
    "prefill": Case("benchmarks.bench_prefill", "end-to-end prefill, base / one / 64 adapters",
                    tiny=("--tiny", "--device", "cpu"), devices=("cuda", "cpu"),
                    device_flag=True),
    "structured": Case("benchmarks.bench_structured",
                       "constrained decode step (0/25/100% of rows) and schema compiles",
                       tiny=("--tiny", "--device", "cpu"), devices=("cuda", "cpu"),
                       device_flag=True),
}

if __name__ == "__main__":
    sys.exit(main("decode", CASES))
