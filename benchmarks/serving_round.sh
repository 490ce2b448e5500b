#!/usr/bin/env bash
# The serving benchmark on one GPU (Llama-3-8B shape, random weights, rank-16 adapters),
# `loramux serve`'s defaults, each run against the offline engine in the same invocation:
#   streams: 64 adapters, closed loops of 64 and 256 streams (target service/offline >= 0.95)
#   zipf:    5 vs 1000 adapters, Zipf(1) popularity, Poisson at $RATE req/s (target >= 0.97
#            of the 5-adapter throughput, SLO attainment >= 0.98)
#   sweep:   64 adapters, Poisson at several rates: latency vs throughput (PNG)
# Pick runs with ROUNDS="streams zipf sweep" (default: all). Under $OUT: <run>.log, and
# <run>/serving.json, table.md and the PNGs.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/loramux-serving}; mkdir -p "$OUT"
RATE=${RATE:-8}
WORK=$(mktemp -d /tmp/loramux-serving.XXXX)   # model and adapter files, shared by the runs
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run() {  # name, timeout seconds, bench flags...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 benchmarks/bench_serving.py --out "$OUT/$name" --workdir "$WORK" "$@" \
    > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"
  sed -n '/^| adapters/,$p' "$OUT/$name.log"
}
for r in ${ROUNDS:-streams zipf sweep}; do
  case $r in
    streams) run streams "${STREAMS_S:-540}" --adapters 64 --concurrency 64,256 ;;
    zipf)    run zipf "${ZIPF_S:-580}" --adapters 5,1000 --popularity zipf:1 --rate "$RATE" ;;
    sweep)   run sweep "${SWEEP_S:-540}" --adapters 64 --sweep "${SWEEP:-2,4,8,16,32}" ;;
  esac
done
