#!/usr/bin/env bash
# Creates .venv (if missing) and installs loramux, its client package and the test tools.
# Sourced by scripts/test.sh and scripts/serve.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# Pinned first so the server package's "torch>=2.4" is already met: on a CPU-only machine
# this is the CPU build; a CUDA machine gets its CUDA build.
pip install -q "torch==${LORAMUX_TORCH_VERSION:-2.13.0}"
pip install -q -e ".[test,dev]" -e clients/python
