#!/usr/bin/env bash
# The whole test suite with every in-process Engine on CUDA (LORAMUX_TEST_DEVICE=cuda, see
# tests/conftest.py), on one GPU machine, in two halves that each fit a 10-minute call:
#   bash scripts/cuda_suite.sh 0 OUT_DIR     # shards 0-4
#   bash scripts/cuda_suite.sh 1 OUT_DIR     # shards 5-9 (same machine: reuses the kernel cache)
# The test files, largest first, are dealt out in snake order over 10 shards; each half runs its
# five shards side by side, each stopped with SIGINT after SHARD_S seconds (default 500; pytest
# still prints its summary). One Triton cache for every shard and every served engine.
# Expected skips: TP tests on one GPU, test_warmup's launch-key checks (the CPU model),
# test_tls without the test extra's cryptography.
set -u
HALF=${1:?half: 0 or 1}; OUT=${2:?output directory}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/clients/python LORAMUX_TEST_DEVICE=cuda OMP_NUM_THREADS=3
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/loramux-triton}
for s in 0 1 2 3 4; do
  g=$((5 * HALF + s))
  F=$(ls -S tests/test_*.py | awk -v g=$g '{i=(NR-1)%20; if((i<10?i:19-i)==g)print}')
  echo $F > "$OUT/files-$g.txt"
  timeout -s INT -k 30 "${SHARD_S:-500}" python3 -m pytest -q -p no:cacheprovider -o addopts= \
    -rfE --tb=line --durations=8 $F > "$OUT/shard-$g.txt" 2>&1 &
done
wait
for s in 0 1 2 3 4; do
  g=$((5 * HALF + s))
  echo "== shard $g: $(cat "$OUT/files-$g.txt")"
  grep -E "^(FAILED|ERROR)|passed|failed|error" "$OUT/shard-$g.txt" | tail -n 15
done
