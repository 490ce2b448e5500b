#!/usr/bin/env bash
# Sets up a fresh machine (virtual environment, every dependency) and runs the whole suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
bash scripts/gen_protos.sh --check
# -P: the working directory is not put first on sys.path (see pyproject's addopts)
python -P -m pytest -q "$@"
