#!/usr/bin/env bash
# Creates the virtual environment (if missing) and installs loramux, its client package and
# the test tools at the versions pinned in constraints.txt (refreshed by scripts/lock.sh).
# Sourced by scripts/test.sh and scripts/serve.sh. LORAMUX_VENV names another environment;
# LORAMUX_CONSTRAINTS= (empty) installs the newest releases instead (scripts/test_latest.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
VENV=${LORAMUX_VENV:-.venv}
CONSTRAINTS=${LORAMUX_CONSTRAINTS-constraints.txt}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
pip install -q --upgrade pip
# Pinned first so the server package's "torch>=2.4" is already met: on a CPU-only machine
# this is the CPU build; a CUDA machine gets its CUDA build.
pip install -q "torch==${LORAMUX_TORCH_VERSION:-2.13.0}"
if [ -n "$CONSTRAINTS" ]; then
    pip install -q -c "$CONSTRAINTS" -e ".[test,dev]" -e clients/python
else
    pip install -q --upgrade --upgrade-strategy eager -e ".[test,dev]" -e clients/python
fi
