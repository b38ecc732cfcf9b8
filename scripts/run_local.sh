#!/usr/bin/env bash
# Set up (idempotent) and run the default local multi-agent training on CPU:
#   bash scripts/run_local.sh [key=value overrides...]
# Output: runs/local/ (config.yaml, local.h5, checkpoints/, train.log).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m flexmarl_hpc.run configs/local.yaml "$@"
