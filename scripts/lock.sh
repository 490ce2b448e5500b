#!/usr/bin/env bash
# Refreshes constraints.txt: resolves the server package, the client package and their
# extras (test, dev) to today's newest releases in a throwaway virtual environment and
# records every version. scripts/setup.sh (the README's commands) and the Dockerfile
# install with it, so a release elsewhere cannot change what main runs.
#   bash scripts/lock.sh
# torch is pinned apart (LORAMUX_TORCH_VERSION in scripts/setup.sh, TORCH_VERSION in the
# Dockerfile): its build differs between CPU and CUDA machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q --upgrade pip
"$tmp/venv/bin/pip" install -q "torch==${LORAMUX_TORCH_VERSION:-2.13.0}"
"$tmp/venv/bin/pip" install -q ".[test,dev]" ./clients/python
{
    echo "# Every version the suite and the image install, from: bash scripts/lock.sh"
    echo "# ($("$tmp/venv/bin/python" -V), $(date -u +%Y-%m-%d)). Edit by re-running it, not by hand."
    "$tmp/venv/bin/pip" freeze --all | grep -viE '^(loramux|loramux-client|torch|nvidia-.*|cuda-.*)( @|==)' \
        | grep -vE '^(pip|setuptools|wheel)==' | LC_ALL=C sort -f
} > constraints.txt
echo "constraints.txt: $(grep -vc '^#' constraints.txt) pins"
