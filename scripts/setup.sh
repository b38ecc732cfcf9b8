#!/usr/bin/env bash
# Idempotent set-up of .venv for flexmarl_hpc on a fresh machine (CPU):
#   bash scripts/setup.sh
# Re-running is a no-op unless requirements changed (a stamp holds their hash).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.flexmarl-stamp
want=$( (cat requirements.txt pyproject.toml; cat requirements-megatron.txt 2>/dev/null || true) | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing python packages into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements.txt
  if [ -f requirements-megatron.txt ]; then
    # megatron-core must not pull another torch: the pin keeps the CPU wheel
    .venv/bin/python -m pip install -q -r requirements-megatron.txt torch==2.13.0
  fi
  # the package itself, editable: `python -m flexmarl_hpc.*` works from any folder (Slurm jobs)
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi
.venv/bin/python -c "import torch, mpi4py, h5py; print(f'[setup] .venv ready: torch {torch.__version__}, h5py {h5py.__version__}')"
