#!/usr/bin/env bash
# The serving benchmark on one GPU (Llama-3-8B shape, random weights, rank-16 adapters),
# `loramux serve`'s defaults, in three rounds of one device call each (ROUNDS=<name>).
# Each round is one bench_serving.py run (one service start for all its points) and ends
# in under 9 minutes on an H100 including a cold start (~240 s to serving: empty Triton
# cache); a later round on the same machine reuses the model files and the compiled
# kernels under $WORK and starts faster.
#
# Time budget (s): no point starts unless it can end by DEADLINE_S (510) after the start;
# then the service stops, plots are drawn (~10-20 s); `timeout` stops the run at 540 s.
#   streams   64 adapters, closed loops of 64 and 256 streams, service then offline
#             (target service/offline >= 0.95). Per point: <= 25 sending + 15 drain.
#             start 240, loads <= 60 (64 adapters: ~10), warm-up round ~10, 2 points
#             <= 80 (~55); offline engine build + warm-up from the cached kernels ~90
#             (started only if 120 + one point fit), loads ~10, warm-up round ~10, 2
#             points ~55. Expected ~480.
#   zipf      Zipf(1) over 5 and over 1000 adapters, Poisson at $RATE req/s first (target:
#             1000 adapters >= 0.97 x the 5-adapter throughput, SLO attainment >= 0.98),
#             then the rates $SWEEP at both counts (PNG of latency vs throughput). No
#             offline twin: below saturation a Poisson run delivers its offered rate on
#             either path. Per point: <= 12 of arrivals + 8 drain (~15). start 240, loads
#             <= LOAD_S (150), warm-up round ~5, 10 points ~150: the last sweep points are
#             the ones skipped when loads are slow. Expected 400-510.
#   adapters  issue 20's sweep: 1, 32, 256, 1000, 2000 adapters x uniform / Zipf(1), 256
#             closed-loop streams, no warm-up round, the first point twice (the first round
#             after start vs steady state). Per point: <= 10 sending + 8 drain (~15).
#             start 240, loads <= LOAD_S (130), 10 points ~150: the 2000-adapter points
#             are the ones skipped when loads are slow. Expected 400-510.
# Under $OUT: <round>.log (rows as points finish) and <round>/ (serving.json, table.md,
# PNGs, the services' logs). The table is printed last.
# TINY=1: the same three rounds on the CPU with the demo model and small counts (a check
# of the script, not a measurement).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/loramux-serving}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/loramux-serving-work}; mkdir -p "$WORK"  # model, adapters, Triton cache
DEADLINE_S=${DEADLINE_S:-510}
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
                --point-s 12 --drain-s 8 --load-s "${LOAD_S:-150}" --no-offline "${EXTRA[@]}" ;;
    adapters) run adapters --adapters "$SWEEP_N" --popularity uniform,zipf:1 \
                --concurrency "$WIDE" --cold-first --no-offline --point-s 10 --drain-s 8 \
                --load-s "${LOAD_S:-130}" "${EXTRA[@]}" ;;
    *) echo "unknown round $r (streams, zipf, adapters)"; exit 2 ;;
  esac
done
