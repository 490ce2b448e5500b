#!/usr/bin/env bash
# One device call on one GPU (H100/H200): the MoE and FP8 CUDA tests, the MoE benchmark
# (layer table, then the Qwen1.5-MoE-A2.7B-shaped model through the engine) and the FP8
# benchmark (GEMMs, then the Llama-3-8B-shaped model). At most 7 files under $OUT:
# tests.log moe.log moe.csv engine.csv fp8.log gemm.csv model.csv. Fits one 10-minute call
# (timeouts 120 + 240 + 200 s).
set -o pipefail
export PYTHONUNBUFFERED=1
# the checkout by its import names, installed or not (scripts/checkout_path.sh)
export PYTHONPATH=$(bash "$(dirname "$0")/../scripts/checkout_path.sh")
OUT=${OUT:-/tmp/loramux-moe-fp8}; mkdir -p "$OUT"
TMP=$(mktemp -d /tmp/loramux-moe-fp8.XXXX)
nvidia-smi --query-gpu=name,memory.total --format=csv
LORAMUX_TEST_DEVICE=cuda timeout ${TESTS_S:-120} python3 -P -m pytest -q tests/test_cuda_moe.py \
  tests/test_kernels_moe.py tests/test_moe_parity.py > "$OUT/tests.log" 2>&1; echo "tests rc=$?"
tail -3 "$OUT/tests.log"
timeout ${MOE_S:-240} python3 -m benchmarks.models moe --out "$TMP/m" > "$OUT/moe.log" 2>&1
echo "moe rc=$?"; cp "$TMP/m/moe.csv" "$TMP/m/engine.csv" "$OUT/" 2>/dev/null
tail -25 "$OUT/moe.log"
timeout ${FP8_S:-200} python3 -m benchmarks.models fp8 --out "$TMP/f" > "$OUT/fp8.log" 2>&1
echo "fp8 rc=$?"; cp "$TMP/f/gemm.csv" "$TMP/f/model.csv" "$OUT/" 2>/dev/null
tail -31 "$OUT/fp8.log"
rm -rf "$TMP"
