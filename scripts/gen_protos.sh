#!/usr/bin/env bash
# Generates the Python code for protos/loramux/v1/*.proto into clients/python/loramux/v1
# (importable as `loramux.v1` by the client package and by the services).
#   bash scripts/gen_protos.sh           regenerate
#   bash scripts/gen_protos.sh --check   exit 1 when the committed generated code is stale
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT_PKG=clients/python/loramux/v1

generate() {  # $1: output root (holds loramux/v1/)
    mkdir -p "$1/loramux/v1"
    "$PY" -m grpc_tools.protoc -I protos \
        --python_out="$1" --grpc_python_out="$1" --pyi_out="$1" \
        protos/loramux/v1/*.proto
    printf '"""Generated from protos/loramux/v1 by scripts/gen_protos.sh; do not edit."""\n' \
        > "$1/loramux/v1/__init__.py"
}

if [ "${1:-}" = "--check" ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    generate "$tmp"
    if ! diff -r -x __pycache__ "$tmp/loramux/v1" "$OUT_PKG" >/dev/null; then
        echo "generated proto code in $OUT_PKG is stale: run bash scripts/gen_protos.sh" >&2
        diff -r -x __pycache__ "$tmp/loramux/v1" "$OUT_PKG" | head -20 >&2 || true
        exit 1
    fi
    echo "generated proto code is up to date"
else
    rm -f "$OUT_PKG"/*_pb2*.py "$OUT_PKG"/*_pb2*.pyi
    generate clients/python
fi
