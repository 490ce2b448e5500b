#!/usr/bin/env bash
# The serving benchmark on one GPU (Llama-3-8B shape, random weights, rank-16 adapters),
# `loramux serve`'s defaults, in three rounds of one device call each (ROUNDS=<name>).
# Each round is one `python -m benchmarks.serving` run (one service start for all its points) and ends
# in under 9 minutes on an H100 including a cold start (~240 s to serving: empty Triton
# cache); a later round on the same machine reuses the model files and the compiled
# kernels under $WORK and starts faster.
#
# Time budget (s): no point starts unless it can end by DEADLINE_S (510; 480 for adapters)
# after the start; then the service stops, plots are drawn (~10-20 s); `timeout` stops the
# run 22 s after the deadline (it still writes its table and plots), kills it 8 s later.
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
#   adapters  issue 20's sweep in one call of <= 8.5 minutes (DEADLINE_S 480 for this round):
#             256 closed-loop streams, every point windowed: WARM_S (4) s of its own
#             warm-up, then measured until POINT_S (17) s (a 13 s window; the drain only
#             waits for the window's first tokens). The first point (5 adapters, Zipf(1))
#             runs right after "serving" with only its adapters loaded, then again (steady:
#             the baseline of the 1,000 / 2,000 targets), then once more while the other
#             1,995 adapters load in the background ("during loads": what loads cost the
#             traffic); the later points start once their adapters are loaded, after up to
#             30 s of waiting for the loads to finish, in the order of ADAPTER_POINTS (the
#             targets' points first). Per point ~20 s. Fresh machine: start ~250 (less
#             with the kernels of an earlier run in TRITON_CACHE_DIR, default the shared
#             ~/.triton/cache), 3 rounds of the first point ~60, loads of 2,000 at >= 50/s
#             mostly hidden in "during loads" (<= 30 s more), then 32u, 256u, 1000z, 2000z,
#             32z, 256z, 1000u (~140): what does not fit by the deadline is skipped (2000u
#             and 1 come last); a start-up 30 s faster runs them all. Slow loads only delay
#             (and skip) the points with many adapters. Ends ~495 s after the call starts.
#             Prints the loads per second and each load's latency as adapters load, the
#             first round over steady state, the targets, then the table.
# Under $OUT: <round>.log (rows as points finish) and <round>/ (serving.json, table.md,
# PNGs, the services' logs). The table is printed last.
# TINY=1: the same three rounds on the CPU with the demo model and small counts (a check
# of the script, not a measurement).
set -o pipefail
export PYTHONUNBUFFERED=1
# the checkout by its import names, installed or not (scripts/checkout_path.sh)
export PYTHONPATH=$(bash "$(dirname "$0")/../scripts/checkout_path.sh")
OUT=${OUT:-/tmp/loramux-serving}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/loramux-serving-work}; mkdir -p "$WORK"  # model, adapters, Triton cache
# kernels compiled by earlier runs on this machine (gpu_round.sh's included) are reused;
# so are those of serving rounds from before this cache was shared (under $WORK)
if [ -z "${TRITON_CACHE_DIR:-}" ]; then
  export TRITON_CACHE_DIR=$HOME/.triton/cache; mkdir -p "$TRITON_CACHE_DIR"
  [ -d "$WORK/triton-cache" ] && cp -rn "$WORK/triton-cache/." "$TRITON_CACHE_DIR/" 2>/dev/null
fi
if [ "${TINY:-0}" = 1 ]; then
  EXTRA=(--tiny --num-requests 8 -- --max-loras 2 --max-cpu-loras 4)
  RATE=${RATE:-20}; SWEEP=${SWEEP:-10,20}; STREAMS=2,4; STREAMS_N=4; ZIPF_N=2,6
  SWEEP_N=1,2,4,8; WIDE=4
  POINTS=${ADAPTER_POINTS:-2/zipf:1,4/uniform,8/zipf:1,8/uniform,1/uniform}
  WARM_S=${WARM_S:-1}; POINT_S=${POINT_S:-4}; WIDE_EXTRA=(--tiny -- --max-loras 3 --max-cpu-loras 5)
else
  EXTRA=()
  RATE=${RATE:-8}; SWEEP=${SWEEP:-4,8,16,32,48}; STREAMS=64,256; STREAMS_N=64; ZIPF_N=5,1000
  SWEEP_N=1,32,256,1000,2000; WIDE=256
  POINTS=${ADAPTER_POINTS:-5/zipf:1,32/uniform,256/uniform,1000/zipf:1,2000/zipf:1,32/zipf:1,256/zipf:1,1000/uniform,2000/uniform,1/uniform}
  WARM_S=${WARM_S:-4}; POINT_S=${POINT_S:-17}; WIDE_EXTRA=()
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
fi
run() {  # name, deadline s, bench flags...
  local name=$1 deadline=$2; shift 2
  local t0=$SECONDS
  # SIGTERM at the deadline + 22 s: the run stops the service and still writes its table
  timeout -k 8 $((deadline + 22)) python3 -m benchmarks.serving --out "$OUT/$name" \
    --workdir "$WORK" --deadline-s "$deadline" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -E '^(service|offline): (serving|ready|loaded|skipped|one adapter)|warm-up|first round|^  service: |^target |adapters load / without' "$OUT/$name.log"
  echo "$name rc=$rc in $((SECONDS - t0)) s"
  [ -n "${EXTRA[*]}" ] || nvidia-smi --query-gpu=memory.used --format=csv,noheader \
    | sed 's/^/GPU memory used after the round: /'
  if [ -f "$OUT/$name/table.md" ]; then cat "$OUT/$name/table.md"
  else grep '^| ' "$OUT/$name.log"; fi  # cut short: the rows printed so far
}
for r in ${ROUNDS:-streams}; do
  case $r in
    streams)  run streams "${DEADLINE_S:-510}" --adapters "$STREAMS_N" --concurrency "$STREAMS" \
                --point-s 25 --drain-s 15 --load-s 60 "${EXTRA[@]}" ;;
    zipf)     run zipf "${DEADLINE_S:-510}" --adapters "$ZIPF_N" --popularity zipf:1 \
                --rate "$RATE" --sweep "$SWEEP" --point-s 12 --drain-s 8 \
                --load-s "${LOAD_S:-150}" --no-offline "${EXTRA[@]}" ;;
    adapters) run adapters "${DEADLINE_S:-480}" --points "$POINTS" --concurrency "$WIDE" \
                --cold-first --background-loads --settle-s "${SETTLE_S:-30}" --no-offline \
                --warm-s "$WARM_S" --point-s "$POINT_S" --drain-s 5 "${WIDE_EXTRA[@]}" ;;
    *) echo "unknown round $r (streams, zipf, adapters)"; exit 2 ;;
  esac
done
