#!/usr/bin/env bash
# Sets up a fresh machine (virtual environment, every dependency) and runs the whole suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# The CPU build of torch on a CPU-only machine; a CUDA machine gets its CUDA build.
pip install -q "torch==2.13.0"
pip install -q -e ".[test]"
[ -f clients/python/pyproject.toml ] && pip install -q -e clients/python
[ -f scripts/gen_protos.sh ] && bash scripts/gen_protos.sh --check
python -m pytest -q "$@"
