#!/usr/bin/env bash
# Prints a PYTHONPATH under which this checkout imports by its own names without being
# installed (a bare GPU machine with torch, no pip access): a folder of links
# loramux_engine -> engine/, loramux_kernels -> kernels/, loramux_services -> services/
# (pyproject's package-dir), loramux_core, and the client SDK's folder.
#   export PYTHONPATH=$(bash scripts/checkout_path.sh)    (keeps what PYTHONPATH had, after)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
names=${TMPDIR:-/tmp}/loramux-names-$(printf '%s' "$root" | cksum | cut -d' ' -f1)
mkdir -p "$names"
for folder in engine kernels services; do ln -sfn "$root/$folder" "$names/loramux_$folder"; done
ln -sfn "$root/loramux_core" "$names/loramux_core"
echo "$names:$root/clients/python${PYTHONPATH:+:$PYTHONPATH}"
