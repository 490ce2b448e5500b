#!/usr/bin/env bash
# Generates the Python code for the protos, each set into the package that ships it:
#   protos/loramux/v1/*.proto      (public API: Generate, AdapterAdmin) -> clients/python/loramux/v1
#                                  (`loramux.v1`, in the client SDK)
#   protos/loramux_core/v1/*.proto (internal engine protocol over ZMQ)  -> loramux_core/v1
#                                  (`loramux_core.v1`, in the server package only)
#   bash scripts/gen_protos.sh           regenerate
#   bash scripts/gen_protos.sh --check   exit 1 when the committed generated code is stale
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
# proto directory (under protos/) -> the output root its package lies under
SETS=("loramux/v1:clients/python" "loramux_core/v1:.")

protoc() {  # $1: proto directory, $2: output root; extra flags follow
    local dir=$1 out=$2
    shift 2
    mkdir -p "$out/$dir"
    "$PY" -m grpc_tools.protoc -I protos --python_out="$out" --pyi_out="$out" "$@" \
        protos/"$dir"/*.proto
    printf '"""Generated from protos/%s by scripts/gen_protos.sh; do not edit."""\n' "$dir" \
        > "$out/$dir/__init__.py"
}

generate() {  # $1: output root replacing every set's own root ("" = the real ones)
    # The public API has services (stubs for the SDK); the engine protocol has none.
    protoc loramux/v1 "${1:-clients/python}" --grpc_python_out="${1:-clients/python}"
    protoc loramux_core/v1 "${1:-.}"
}

if [ "${1:-}" = "--check" ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    generate "$tmp"
    stale=0
    for set in "${SETS[@]}"; do
        dir=${set%%:*} root=${set#*:}
        if ! diff -r -x __pycache__ "$tmp/$dir" "$root/$dir" >/dev/null; then
            echo "generated proto code in $root/$dir is stale: run bash scripts/gen_protos.sh" >&2
            diff -r -x __pycache__ "$tmp/$dir" "$root/$dir" | head -20 >&2 || true
            stale=1
        fi
    done
    [ "$stale" = 0 ] || exit 1
    echo "generated proto code is up to date"
else
    for set in "${SETS[@]}"; do
        dir=${set%%:*} root=${set#*:}
        rm -f "$root/$dir"/*_pb2*.py "$root/$dir"/*_pb2*.pyi
    done
    generate ""
fi
