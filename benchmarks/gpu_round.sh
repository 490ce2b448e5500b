#!/usr/bin/env bash
# One device call: CUDA tests of the kernels and graphs, then the kernel target grid and
# the engine decode benchmark (HF + PEFT baseline in the same run), then the engine parity
# tests on CUDA (appended to tests.log). Logs under $OUT, at most 8 result files.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/loramux-gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
python3 -m pytest -q -x tests/test_kernels_lora.py tests/test_kernels_elementwise.py \
  tests/test_kernels_attention.py tests/test_cuda_graphs.py tests/test_cuda_graph_logic.py \
  tests/test_cuda_dummy_weights.py 2>&1 | tee "$OUT/tests.log" | tail -5 || exit 1
python3 benchmarks/bench_kernels.py --targets --out "$OUT/k" > "$OUT/kernels.log" 2>&1
tail -40 "$OUT/kernels.log"
python3 benchmarks/bench_decode.py --out "$OUT/d" --steps 12 > "$OUT/decode.log" 2>&1
grep -v "^ " "$OUT/decode.log" | grep -E "^hf-peft|^\| " | tail -30
LORAMUX_TEST_DEVICE=cuda timeout ${PARITY_S:-120} python3 -m pytest -q -x \
  tests/test_engine_parity.py 2>&1 | tee -a "$OUT/tests.log" | tail -3
