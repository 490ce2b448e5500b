#!/usr/bin/env bash
# One device call on a machine with >= 2 GPUs: TP=2 vs TP=1 parity with NCCL in bf16 on a
# tiny model, then decode throughput TP=1 vs TP=2 on the Llama-3-8B-shaped model. Logs under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/loramux-tp}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 benchmarks/bench_tp.py parity --tp 2 --out "$OUT" > "$OUT/parity.log" 2>&1; echo "parity rc=$?"
tail -14 "$OUT/parity.log"
python3 benchmarks/bench_tp.py decode --tp 1 --out "$OUT" > "$OUT/decode1.log" 2>&1; echo "decode tp1 rc=$?"
python3 benchmarks/bench_tp.py decode --tp 2 --out "$OUT" > "$OUT/decode2.log" 2>&1; rc=$?; echo "decode tp2 rc=$rc"
if [ $rc -ne 0 ]; then
  tail -30 "$OUT/decode2.log"
  python3 benchmarks/bench_tp.py decode --tp 2 --eager --out "$OUT" > "$OUT/decode2e.log" 2>&1
  echo "decode tp2 eager rc=$?"
fi
grep -h "^tp=" "$OUT"/decode*.log
