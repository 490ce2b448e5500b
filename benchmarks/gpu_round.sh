#!/usr/bin/env bash
# One device call on one GPU (about 9.5 minutes at most): the kernel target grid, the engine
# decode benchmark (its default, async scheduling on; HF + PEFT baseline in the same run) at
# batches 1/16/64/256, the end-to-end prefill benchmark (base, one adapter, 64 adapters; the
# LoRA prefill kernels before and after), and, only when SYNC_S is set, batches 64 and 256
# again with async scheduling off. At most 8 files under $OUT:
# kernels.log kernels.csv decode.log decode.json decode_throughput.png profile.txt
# prefill.log (and decode_sync.log). Time limits: KERNELS_S DECODE_S PREFILL_S SYNC_S.
# DECODE_ARGS: more options of `python -m benchmarks.decode` (e.g. "--no-hf --profile-batches 64,256").
# The CUDA test suite is a separate call: python3 scripts/cuda_suite.py --out DIR.
set -o pipefail
export PYTHONUNBUFFERED=1
# the checkout by its import names, installed or not (scripts/checkout_path.sh)
export PYTHONPATH=$(bash "$(dirname "$0")/../scripts/checkout_path.sh")
OUT=${OUT:-/tmp/loramux-gpu}; mkdir -p "$OUT"
TMP=$(mktemp -d /tmp/loramux-round.XXXX)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
timeout ${KERNELS_S:-190} python3 -m benchmarks.kernels lora --out "$TMP/k" --targets \
  > "$OUT/kernels.log" 2>&1; echo "kernels rc=$?"
cp "$TMP/k/kernels.csv" "$OUT/" 2>/dev/null
tail -35 "$OUT/kernels.log"
timeout ${DECODE_S:-240} python3 -m benchmarks.decode --out "$TMP/d" --steps 16 \
  --batches 1,16,64,256 ${DECODE_ARGS:-} > "$OUT/decode.log" 2>&1; echo "decode rc=$?"
cp "$TMP/d/decode.json" "$TMP/d/decode_throughput.png" "$TMP/d/profile.txt" "$OUT/" 2>/dev/null
grep -E "^async|^hf-peft|^\| " "$OUT/decode.log" | tail -34
timeout ${PREFILL_S:-140} python3 -m benchmarks.decode prefill --out "$TMP/p" \
  > "$OUT/prefill.log" 2>&1; echo "prefill rc=$?"
grep -E "^device|^prefill|^\| " "$OUT/prefill.log"
if [ -n "${SYNC_S:-}" ]; then
  timeout "$SYNC_S" python3 -m benchmarks.decode --out "$TMP/s" --steps 16 --no-hf \
    --async-scheduling off --batches 64,256 > "$OUT/decode_sync.log" 2>&1; echo "sync rc=$?"
  grep -E "^async|^loramux" "$OUT/decode_sync.log"
fi
