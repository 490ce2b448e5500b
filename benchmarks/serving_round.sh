#!/usr/bin/env bash
# The serving benchmark on one GPU (Llama-3-8B shape, random weights, rank-16 adapters),
# `loramux serve`'s defaults, in three rounds of one device call each (ROUNDS=<name>).
# Each round is one bench_serving.py run (one service start for all its points) and ends
# within 540 s on an H100, including a cold start (~240 s: empty Triton cache); a later
# round on the same machine reuses the model files and the compiled kernels under $WORK.
#
#   streams   64 adapters, closed loops of 64 and 256 streams, service then offline
#             (target service/offline >= 0.95). Per point <= 25 s sending + 15 s drain.
#             start 240 + loads ~10 + warm-up round ~10 + 2 x <=40, then the offline
#             engine: build + warm-up from the cached kernels ~90 + loads ~10 + warm-up
#             round ~10 + 2 x <=40 = ~530 s worst case, ~450 s expected.
#   zipf      Zipf(1) popularity over 5 and over 1000 adapters, Poisson at $RATE req/s
#             first (target: 1000 adapters >= 0.97 x the 5-adapter throughput, SLO
#             attainment >= 0.98), then the rate sweep $SWEEP at both counts (PNG of
#             latency vs throughput); no offline twin (below saturation a Poisson run
#             delivers its offered rate on either path). Per point <= 12 s of arrivals +
#             8 s drain, 10 points: start 240 + loads <= 90 + warm-up ~10 + 10 x <=20.
#   adapters  issue 20's sweep: 1, 32, 256, 1000, 2000 adapters x uniform / Zipf(1), 256
#             closed-loop streams, no warm-up round: the first point runs twice (first
#             round after start vs steady state). Per point <= 10 s sending + 8 s drain,
#             10 points: start 240 + loads <= 100 + 10 x <= 18.
# Points that could not end before the round's deadline (DEADLINE_S, 530 s) are skipped
# and adapter loads stop after LOAD_S, so a slow part leaves a table rather than a
# timeout. Under $OUT: <round>.log (rows as points finish) and <round>/ (serving.json,
# table.md, PNGs, the services' logs). The table is printed last.
# TINY=1: the same three rounds on the CPU with the demo model and small counts (a check
# of the script, not a measurement).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/loramux-serving}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/loramux-serving-work}; mkdir -p "$WORK"  # model, adapters, Triton cache
DEADLINE_S=${DEADLINE_S:-530}
if [ "${TINY:-0}" = 1 ]; then
  EXTRA=(--tiny --num-requests 8 -- --max-loras 2 --max-cpu-loras 4)
  RATE=${RATE:-20}; SWEEP=${SWEEP:-10,20}; STREAMS=2,4; STREAMS_N=4; ZIPF_N=2,6
  SWEEP_N=1,2,4,8; WIDE=4
else
  EXTRA=()
  RATE=${RATE:-8}; SWEEP=${SWEEP:-4,8,16,32,48}; STREAMS=64,256; STREAMS_N=64; ZIPF_N=5,1000
  SWEEP_N=1,32,256,1000,2000; WIDE=256
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
fi
run() {  # name, bench flags...
  local name=$1; shift
  local t0=$SECONDS
  timeout -k 30 $((DEADLINE_S + 30)) python3 benchmarks/bench_serving.py --out "$OUT/$name" \
    --workdir "$WORK" --deadline-s "$DEADLINE_S" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -E '^(service|offline): (serving|ready|loaded|skipped)|warm-up|first round' "$OUT/$name.log"
  echo "$name rc=$rc in $((SECONDS - t0)) s"
  [ -n "${EXTRA[*]}" ] || nvidia-smi --query-gpu=memory.used --format=csv,noheader \
    | sed 's/^/GPU memory used after the round: /'
  if [ -f "$OUT/$name/table.md" ]; then cat "$OUT/$name/table.md"
  else grep '^| ' "$OUT/$name.log"; fi  # cut short: the rows printed so far
}
for r in ${ROUNDS:-streams}; do
  case $r in
    streams)  run streams --adapters "$STREAMS_N" --concurrency "$STREAMS" --point-s 25 \
                --drain-s 15 --load-s 60 "${EXTRA[@]}" ;;
    zipf)     run zipf --adapters "$ZIPF_N" --popularity zipf:1 --rate "$RATE" --sweep "$SWEEP" \
                --point-s 12 --drain-s 8 --load-s "${LOAD_S:-90}" --no-offline "${EXTRA[@]}" ;;
    adapters) run adapters --adapters "$SWEEP_N" --popularity uniform,zipf:1 \
                --concurrency "$WIDE" --cold-first --no-offline --point-s 10 --drain-s 8 \
                --load-s "${LOAD_S:-100}" "${EXTRA[@]}" ;;
    *) echo "unknown round $r (streams, zipf, adapters)"; exit 2 ;;
  esac
done
