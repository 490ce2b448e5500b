#!/usr/bin/env bash
# One device call on a machine with 2 GPUs, about 9 minutes (TOTAL_S, default 540 s): what
# tensor parallelism costs and pays on the Llama-3-8B shape.
#   1. the one-shot all-reduce (symmetric memory) against NCCL: checks, then us per
#      all-reduce (bench_tp.py allreduce);
#   2. decode TP=1 at batches 64, 1, 256 (modes base/one/distinct), two processes side by
#      side, one per GPU (64 and 1 on GPU 0, 256 on GPU 1);
#   3. decode TP=2 over NCCL, async scheduling off and on, the same points, with a profile
#      of 5 steps at batch 64 with async on (base and 64 distinct adapters: collectives
#      counted per step);
#   4. the same over the one-shot all-reduce, when phase 1's checks passed;
#   5. with REPLICAS=1 and enough time left, bench_replicas.py (1 replica on 1 GPU vs 2
#      replicas on 2), bounded by what is left; it needs an engine warm-up per layout
#      (minutes on a fresh machine), so it usually wants a call of its own: REPLICAS=only.
# Every phase runs under `timeout` and writes its JSON after every point, so a phase cut
# off keeps what it measured. Parity is left to the CPU tests (tests/test_tp_*.py: TP=2
# equals TP=1 token for token in float32, async and sync).
# Logs under $OUT (at most 8 files): summary.txt (the table, last), allreduce.log,
# tp1.log, tp2_nccl.log (with the profile), tp2_1shot.log, results.json, replicas.log.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}   # shared by every phase
OUT=${OUT:-/tmp/loramux-tp}; mkdir -p "$OUT"
JSON=${JSON:-$(mktemp -d /tmp/loramux-tp-json.XXXX)}
TOTAL_S=${TOTAL_S:-540}; REPLICAS=${REPLICAS:-0}
AR_S=${AR_S:-60}; TP1_S=${TP1_S:-130}; TP2_S=${TP2_S:-150}
STEPS=${STEPS:-12}; REPEATS=${REPEATS:-3}
DEVICE=${DEVICE:-cuda}   # cpu: a dry run of this script on gloo with the tiny test model
B="python3 benchmarks/bench_tp.py"
START=$SECONDS
left() { echo $((TOTAL_S - (SECONDS - START))); }
limit() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo "$((l > 5 ? l - 5 : 1))"; }
stamp() { echo "[$(date +%T) +$((SECONDS - START))s] $*" | tee -a "$OUT/summary.txt"; }
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 || echo "no GPU"; } | tee "$OUT/summary.txt"
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /' | tee -a "$OUT/summary.txt"
DEC="decode --device $DEVICE --steps $STEPS --repeats $REPEATS --modes base,one,distinct"

if [ "$REPLICAS" != only ]; then
  t=$(limit "$AR_S")
  stamp "1. allreduce (limit ${t}s)"
  timeout -k 10 "$t" $B allreduce --tp 2 --timeout $((t > 20 ? t - 10 : t)) --out "$JSON" \
    > "$OUT/allreduce.log" 2>&1; ar=$?
  stamp "allreduce rc=$ar"
  grep -v '^ \|^{\|^}\|^\]' "$OUT/allreduce.log" | tail -14

  t=$(limit "$TP1_S")
  stamp "2. decode TP=1, batches 64,1 on GPU 0 and 256 on GPU 1 (limit ${t}s)"
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 "$t" $B $DEC --tp 1 --batches 64,1 --out "$JSON/tp1a" \
    > "$JSON/tp1a.log" 2>&1 & a=$!
  CUDA_VISIBLE_DEVICES=1 timeout -k 10 "$t" $B $DEC --tp 1 --batches 256 --out "$JSON/tp1b" \
    > "$JSON/tp1b.log" 2>&1 & b=$!
  wait $a; ra=$?; wait $b; rb=$?
  cat "$JSON/tp1a.log" "$JSON/tp1b.log" > "$OUT/tp1.log"
  stamp "decode TP=1 rc=$ra,$rb"

  for ar_mode in nccl symm_mem; do
    name=$([ $ar_mode = nccl ] && echo nccl || echo 1shot)
    n=$([ $ar_mode = nccl ] && echo 3 || echo 4)
    if [ $ar_mode = symm_mem ] && [ "$ar" -ne 0 ]; then
      stamp "4. decode TP=2 one-shot skipped: the allreduce checks did not pass"; continue
    fi
    t=$(limit "$TP2_S")
    stamp "$n. decode TP=2 $name, async off,on (profile: on) at 64 (limit ${t}s)"
    timeout -k 10 "$t" $B $DEC --tp 2 --allreduce $ar_mode --batches 64,1,256 \
      --async-scheduling off,on --profile --profile-batches 64 --out "$JSON/tp2_$name" \
      > "$OUT/tp2_$name.log" 2>&1; rc=$?
    stamp "decode TP=2 $name rc=$rc"
    [ $rc -ne 0 ] && tail -15 "$OUT/tp2_$name.log"
  done
  grep -h -A24 "^profile tp=2 ar=nccl base b=64:" "$OUT/tp2_nccl.log" | head -26
fi

if [ "$REPLICAS" = 1 ] || [ "$REPLICAS" = only ]; then
  t=$(left)
  if [ "$t" -lt 240 ] && [ "$REPLICAS" = 1 ]; then
    stamp "5. replicas skipped: ${t}s left (an engine warm-up per layout needs more)"
  else
    t=$(limit "${REPLICAS_S:-$t}")
    stamp "5. bench_replicas 1x1 vs 2x1 (limit ${t}s)"
    # SIGINT: the benchmark stops its services on the way out
    timeout -s INT -k 30 "$t" python3 benchmarks/bench_replicas.py --out "$JSON/replicas" --layouts 1x1,2x1 \
      --adapters 16 --requests-per-gpu 96 --concurrency-per-gpu 48 --input-len 128:512 \
      --output-len 64:128 --point-s 45 --drain-s 20 > "$OUT/replicas.log" 2>&1
    stamp "replicas rc=$?"
  fi
fi

stamp "table"
$B table --out "$JSON" --results "$OUT/results.json" 2>&1 | tee -a "$OUT/summary.txt"
[ -f "$JSON/replicas/table.md" ] && tee -a "$OUT/summary.txt" < "$JSON/replicas/table.md"
exit 0
