#!/usr/bin/env bash
# Set-up of a GPU site's venv for flexmarl_hpc (Linux x86_64, glibc 2.31+, a CUDA 13 driver):
#   PYTHON=python3.11 bash scripts/setup_gpu.sh                  # -> .venv-gpu
#   PYTHON=python3.11 bash scripts/setup_gpu.sh /scratch/venv-gpu
# Installs requirements-gpu.lock: every package at an exact version, checked against its hash
# (pip --require-hashes), wheels only: PyPI's CUDA torch 2.13.0, vllm 0.32.0, megatron-core
# and the rest of requirements*.txt; then this package (editable), and prints what it has.
# Needs PyPI or a mirror of it (several GB of CUDA wheels; torch alone is 527 MB). A site pip
# config that offers another torch build fails the hash check instead of installing it. Not
# run in CI (no GPU there): docs/environment.md, which also says why Transformer Engine is not in the lock.
# Re-running is a no-op unless the lock or pyproject.toml changed (a stamp holds their hash).
set -euo pipefail
usage() { echo "usage: [PYTHON=python3.11] bash scripts/setup_gpu.sh [VENV_DIR]  (default .venv-gpu)" >&2; exit 2; }
[ $# -le 1 ] || usage
case "${1:-}" in -h|--help) usage ;; -*) echo "[setup_gpu] unknown option: $1" >&2; usage ;; esac
VENV=$(realpath -m "${1:-$(dirname "$0")/../.venv-gpu}")
PY=${PYTHON:-python3}
# the lock is for CPython 3.11 only (numpy, h5py, torch ... are cp311 wheels)
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null \
  || { echo "[setup_gpu] PYTHON=$PY is not Python 3.11 (requirements-gpu.lock is for 3.11)" >&2; exit 2; }
cd "$(dirname "$0")/.."
want=$(cat requirements-gpu.lock pyproject.toml | sha256sum | cut -c1-16)
stamp="$VENV/.flexmarl-gpu-stamp"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup_gpu] installing the locked packages (requirements-gpu.lock) into $VENV"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  echo '*' > "$VENV/.gitignore"    # a venv inside the repo must never be committed
  "$VENV/bin/python" -m pip install -q pip==26.3
  "$VENV/bin/python" -m pip install -q --require-hashes --only-binary=:all: -r requirements-gpu.lock
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi
"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md
import torch
print(f"[setup_gpu] torch {torch.__version__} (CUDA {torch.version.cuda}): "
      f"cuda available {torch.cuda.is_available()}, {torch.cuda.device_count()} GPU(s)")
for dist in ("vllm", "megatron-core", "mpi4py", "h5py", "transformer-engine"):
    try:
        print(f"[setup_gpu] {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"[setup_gpu] {dist}: not installed (see docs/environment.md)")
import megatron.core, mpi4py.MPI, vllm  # noqa: E401,F401  the imports the GPU path makes
PYEOF
