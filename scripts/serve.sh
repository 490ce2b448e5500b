#!/usr/bin/env bash
# Sets up a fresh machine and serves: control plane, engine and gateway on this machine.
# With no arguments it serves a small demo model with two adapters; extra arguments go to
# `loramux serve` (e.g. --model DIR --adapter-root DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
exec loramux serve "$@"
