#!/usr/bin/env bash
# One device call on a machine with >= 2 GPUs (about 9 minutes at most): the one-shot
# all-reduce against NCCL (checks, then us per all-reduce), TP=2 vs TP=1 parity in bf16 on
# a tiny model, then decode throughput on the Llama-3-8B shape: TP=1, TP=2 over NCCL (with
# a profile of 5 steps at batch 64), TP=2 over the one-shot all-reduce when its checks
# passed. Logs under $OUT (6 files); the JSON results stay in $JSON (also printed in logs).
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/loramux-tp}; mkdir -p "$OUT"
JSON=${JSON:-$(mktemp -d /tmp/loramux-tp-json.XXXX)}
AR_S=${AR_S:-75}; PARITY_S=${PARITY_S:-170}; DECODE_S=${DECODE_S:-100}
B="python3 benchmarks/bench_tp.py"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/summary.txt"
stamp() { echo "[$(date +%T)] $*" | tee -a "$OUT/summary.txt"; }

stamp "allreduce (limit ${AR_S}s)"
timeout "$AR_S" $B allreduce --tp 2 --timeout $((AR_S - 15)) --out "$JSON" > "$OUT/allreduce.log" 2>&1; ar=$?
stamp "allreduce rc=$ar"
grep -v '^ \|^{\|^}\|^\]' "$OUT/allreduce.log" | tail -25

PAR_AR=nccl; [ $ar -eq 0 ] && PAR_AR=auto   # the engine's default where one-shot passed
stamp "parity --allreduce $PAR_AR (limit ${PARITY_S}s)"
timeout "$PARITY_S" $B parity --tp 2 --allreduce $PAR_AR --out "$JSON" > "$OUT/parity.log" 2>&1
stamp "parity rc=$?"
grep -v '^ \|^{\|^}' "$OUT/parity.log" | tail -12

stamp "decode tp1 (limit ${DECODE_S}s)"
timeout "$DECODE_S" $B decode --tp 1 --out "$JSON" > "$OUT/decode_tp1.log" 2>&1
stamp "decode tp1 rc=$?"
stamp "decode tp2 nccl + profile (limit ${DECODE_S}s)"
timeout "$DECODE_S" $B decode --tp 2 --allreduce nccl --profile --out "$JSON" \
  > "$OUT/decode_tp2_nccl.log" 2>&1; rc=$?
stamp "decode tp2 nccl rc=$rc"
[ $rc -ne 0 ] && tail -20 "$OUT/decode_tp2_nccl.log"
if [ $ar -eq 0 ]; then
  stamp "decode tp2 symm_mem (limit ${DECODE_S}s)"
  timeout "$DECODE_S" $B decode --tp 2 --allreduce symm_mem --out "$JSON" \
    > "$OUT/decode_tp2_symm.log" 2>&1; rc=$?
  stamp "decode tp2 symm_mem rc=$rc"
  [ $rc -ne 0 ] && tail -20 "$OUT/decode_tp2_symm.log"
else
  stamp "decode tp2 symm_mem skipped: the allreduce phase did not pass"
fi
grep -h "engine up\|^tp=\|^breakdown" "$OUT"/decode_*.log | tee -a "$OUT/summary.txt"
grep -h -A22 "^profile:" "$OUT/decode_tp2_nccl.log"
grep -h "^profile GPU" "$OUT/decode_tp2_nccl.log" | tee -a "$OUT/summary.txt"
