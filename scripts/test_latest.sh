#!/usr/bin/env bash
# The whole suite against today's newest releases of every dependency (constraints.txt
# ignored), in its own environment .venv-latest: what the next `bash scripts/lock.sh` would
# bring in. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
LORAMUX_VENV=.venv-latest LORAMUX_CONSTRAINTS= exec bash scripts/test.sh "$@"
