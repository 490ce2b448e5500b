"""Generated from protos/loramux/v1 by scripts/gen_protos.sh; do not edit."""
