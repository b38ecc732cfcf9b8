#!/usr/bin/env bash
# Idempotent set-up of .venv for flexmarl_hpc on a fresh machine (CPU):
#   bash scripts/setup.sh
# Installs requirements.lock: every package at an exact version, checked against its hash
# (pip --require-hashes), torch the 2.13.0 CPU wheel. The lock covers requirements.txt,
# requirements-megatron.txt and requirements-loggers.txt; `bash scripts/lock.sh` refreshes it.
# Re-running is a no-op unless the lock or pyproject.toml changed (a stamp holds their hash).
# Then Debian's chromium (scripts/setup_chromium.sh: apt-get when missing and root; the
# transcripts page test screenshots with it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.flexmarl-stamp
want=$(cat requirements.lock pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing the locked python packages (requirements.lock) into .venv"
  .venv/bin/python -m pip install -q pip==26.3
  .venv/bin/python -m pip install -q --require-hashes -r requirements.lock
  # the package itself, editable: `python -m flexmarl_hpc.*` works from any folder (Slurm jobs)
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi
# headless Chromium for the transcripts page test (a no-op when present or not root)
bash scripts/setup_chromium.sh
.venv/bin/python -c "import torch, mpi4py, h5py; print(f'[setup] .venv ready: torch {torch.__version__}, h5py {h5py.__version__}')"
