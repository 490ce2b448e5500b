#!/usr/bin/env bash
# One device call on a machine with 2 GPUs, about 5 minutes of run time (TOTAL_S, default
# 285 s): what tensor parallelism costs and pays on the Llama-3-8B shape. Phases in order
# of value, each bounded by `timeout` and by what is left of TOTAL_S; every phase writes
# its JSON after every point, so one cut off keeps what it measured:
#   1. decode TP=1, batches 64 and 1 on GPU 0 and 256 on GPU 1 side by side (modes base,
#      one, distinct; async scheduling, the default on one GPU);
#   2. decode TP=2 with the engine's all-reduce (auto: the one-shot over symmetric memory
#      when its start-up self-tests against NCCL pass on both ranks, else NCCL): at batch
#      64 every mode with async scheduling on, then off, then a profile of 5 steps (base
#      and 64 distinct adapters: collectives counted per step); then batches 1 and 256;
#   2b. on a machine of 4 GPUs or more: decode TP=4, batches 256 and 64, async on
#      (TP4_S, default 100 s);
#   3. the same over NCCL, when phase 2 ran the one-shot (batch 64 first);
#   4. the all-reduce microbench (one-shot against NCCL: checks, us per all-reduce);
#   5. REPLICAS=1: the replicas case (1 replica on 1 GPU vs 2 on 2; on 4 GPUs also 4x1,
#      2x2 and 1x4: LAYOUTS) if 240 s are left; an
#      engine warm-up per layout takes minutes on a fresh machine, so it wants a call of
#      its own: REPLICAS=only TOTAL_S=540.
# Parity is left to the CPU tests (tests/test_tp_*.py: TP=2 equals TP=1 token for token in
# float32, async and sync). DEVICE=cpu dry-runs the decode phases on gloo (tiny model).
# Logs under $OUT (at most 9 files): summary.txt (the table, last), tp1.log, tp2_auto.log
# (with the profile), tp2_nccl.log, tp4_auto.log, allreduce.log, results.json,
# tp_curve.png (best tok/s over the TP sizes), replicas.log.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the checkout by its import names, installed or not (scripts/checkout_path.sh)
export PYTHONPATH=$(bash "$(dirname "$0")/../scripts/checkout_path.sh")
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}   # shared by every phase
OUT=${OUT:-/tmp/loramux-tp}; mkdir -p "$OUT"
JSON=${JSON:-$(mktemp -d /tmp/loramux-tp-json.XXXX)}; mkdir -p "$JSON"
TOTAL_S=${TOTAL_S:-285}; REPLICAS=${REPLICAS:-0}
TP1_S=${TP1_S:-90}; TP2_S=${TP2_S:-120}; AR_S=${AR_S:-45}; TP4_S=${TP4_S:-100}
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
if [ "${NGPU:-0}" -ge 4 ]; then LAYOUTS=${LAYOUTS:-1x1,2x1,4x1,2x2,1x4}; else LAYOUTS=${LAYOUTS:-1x1,2x1}; fi
STEPS=${STEPS:-20}; REPEATS=${REPEATS:-3}   # 3 timed runs of 20 back-to-back steps a point
DEVICE=${DEVICE:-cuda}
B="python3 -m benchmarks.parallel"
DEC="$B decode --device $DEVICE --steps $STEPS --repeats $REPEATS --modes base,one,distinct"
START=$SECONDS
left() { echo $((TOTAL_S - (SECONDS - START))); }
limit() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo "$((l > 5 ? l - 5 : 1))"; }
stamp() { echo "[$(date +%T) +$((SECONDS - START))s] $*" | tee -a "$OUT/summary.txt"; }
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 || echo "no GPU"; } \
  | tee "$OUT/summary.txt"
# LORAMUX_COMMIT names the tree where a copy of it carries no git history of its own
echo "commit ${LORAMUX_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" | tee -a "$OUT/summary.txt"

tp2() {  # tp2 ALLREDUCE LIMIT: TP=2 decode, async on then off, profile at 64
  timeout -k 10 "$2" $DEC --tp 2 --allreduce "$1" --batches 64,1,256 --async-scheduling on,off \
    --profile --profile-batches 64 --out "$JSON/tp2_$1" > "$OUT/tp2_$1.log" 2>&1; local rc=$?
  grep -h "engine up" "$OUT/tp2_$1.log" | tee -a "$OUT/summary.txt"
  stamp "decode TP=2 $1 rc=$rc"
  [ $rc -ne 0 ] && tail -8 "$OUT/tp2_$1.log"
}

if [ "$REPLICAS" != only ]; then
  t=$(limit "$TP1_S")
  stamp "1. decode TP=1: 64,1 on GPU 0, 256 on GPU 1 (limit ${t}s)"
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 "$t" $DEC --tp 1 --batches 64,1 --out "$JSON/tp1a" \
    > "$JSON/tp1a.log" 2>&1 & a=$!
  CUDA_VISIBLE_DEVICES=1 timeout -k 10 "$t" $DEC --tp 1 --batches 256 --out "$JSON/tp1b" \
    > "$JSON/tp1b.log" 2>&1 & b=$!
  wait $a; ra=$?; wait $b; rb=$?
  cat "$JSON/tp1a.log" "$JSON/tp1b.log" > "$OUT/tp1.log"
  stamp "decode TP=1 rc=$ra,$rb"

  t=$(limit "$TP2_S")
  stamp "2. decode TP=2, all-reduce auto (limit ${t}s)"
  tp2 auto "$t"
  grep -h -A24 "^profile tp=2 ar=auto base b=64:" "$OUT/tp2_auto.log" | head -26

  if [ "${NGPU:-0}" -ge 4 ] && [ "$(left)" -ge 60 ]; then
    t=$(limit "$TP4_S")
    stamp "2b. decode TP=4, all-reduce auto (limit ${t}s)"
    timeout -k 10 "$t" $DEC --tp 4 --allreduce auto --batches 256,64 --async-scheduling on \
      --out "$JSON/tp4_auto" > "$OUT/tp4_auto.log" 2>&1
    stamp "decode TP=4 rc=$?"
  fi

  if grep -q "in use=one-shot" "$OUT/tp2_auto.log"; then
    t=$(left); t=$((t - AR_S > 40 ? t - AR_S : t))
    stamp "3. decode TP=2, NCCL (limit $(limit "$t")s)"
    tp2 nccl "$(limit "$t")"
  else
    stamp "3. skipped: phase 2 ran NCCL already (the one-shot was not set up)"
  fi

  if [ "$(left)" -ge 30 ]; then
    t=$(limit "$AR_S")
    stamp "4. all-reduce microbench (limit ${t}s)"
    timeout -k 10 "$t" $B allreduce --tp 2 --timeout $((t > 20 ? t - 10 : t)) --out "$JSON" \
      > "$OUT/allreduce.log" 2>&1
    stamp "allreduce rc=$?"
    grep -v '^ \|^{\|^}\|^\]' "$OUT/allreduce.log" | tail -14
  else
    stamp "4. all-reduce microbench skipped: $(left)s left"
  fi
fi

if [ "$REPLICAS" = 1 ] || [ "$REPLICAS" = only ]; then
  if [ "$(left)" -lt 240 ]; then
    stamp "5. replicas skipped: $(left)s left (an engine warm-up per layout needs more)"
  else
    t=$(limit "$(left)")
    stamp "5. replicas $LAYOUTS (limit ${t}s)"
    # SIGINT: the benchmark stops its services on the way out
    timeout -s INT -k 30 "$t" $B replicas --out "$JSON/replicas" \
      --layouts "$LAYOUTS" --adapters 16 --requests-per-gpu 96 --concurrency-per-gpu 48 \
      --input-len 128-512 --output-len 64-128 --point-s 45 --drain-s 20 > "$OUT/replicas.log" 2>&1
    stamp "replicas rc=$?"
  fi
fi

stamp "rank 0's step at batch 64 (host to replay / replay GPU; with async on the host part overlaps)"
grep -h "^breakdown .* b= 64" "$OUT"/tp*.log 2>/dev/null | tee -a "$OUT/summary.txt"
stamp "table"
$B table --out "$JSON" --results "$OUT/results.json" 2>&1 | tee -a "$OUT/summary.txt"
[ -f "$JSON/replicas/table.md" ] && tee -a "$OUT/summary.txt" < "$JSON/replicas/table.md"
exit 0
