"""Generated from protos/loramux_core/v1 by scripts/gen_protos.sh; do not edit."""
