#!/usr/bin/env bash
# Check the megatron backend against other megatron-core releases, in a side venv (not .venv,
# not part of CI; the repo is used through PYTHONPATH, so its egg-info is left alone):
#
#   bash scripts/check_megatron_versions.sh 0.19.2 0.18.2 0.17.1
#   PYTHON=/root/.pyenv/versions/3.12.1/bin/python3.12 bash scripts/check_megatron_versions.sh 0.19.2
#       (where the pyenv shim python3.12 is not activated)
#
# For each VERSION: pip install megatron-core==VERSION into the side venv, then run under
# CI=true tests/mpi/test_megatron.py (dp/tp/pp/ckpt on 2 ranks, tp+tppp on 4; the `ok ...` lines
# are printed), tests/unit/test_convert.py and tests/e2e/test_run.py's megatron run. Stops at the first
# failure. megatron-core >= 0.17 needs Python >= 3.12, 0.16 runs on 3.11; the venv is
# $VENV (default /tmp/venv-mcore-pyX.Y), built with $PYTHON (default: python3.12, or
# python3.11 when every VERSION is 0.16.x). torch is pinned to 2.13.0: for 3.11 pip takes the
# local CPU wheel; for 3.12 it downloads PyPI's CUDA build (measured: 4.9 GB venv, about
# 1 min to build; it runs on CPU). Each version's tests take 1.5-2 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
[ $# -gt 0 ] || set -- 0.19.2
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3.11
  for v in "$@"; do case $v in 0.16.*) ;; *) PYTHON=python3.12 ;; esac; done
fi
PYV=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) \
  || { echo "[check] $PYTHON does not run: set PYTHON=/path/to/python3.12" >&2; exit 2; }
VENV=${VENV:-/tmp/venv-mcore-py$PYV}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[check] building $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
  # requirements.txt minus the plotting packages, which the checks don't use
  grep -v -E '^(pandas|matplotlib)' requirements.txt > "$VENV/requirements-check.txt"
  "$VENV/bin/python" -m pip install -q -r "$VENV/requirements-check.txt"
fi
for v in "$@"; do
  echo "[check] megatron-core $v (python $PYV, $VENV)"
  # torch pinned so that megatron-core's torch>=2.6 does not pull another build
  "$VENV/bin/python" -m pip install -q "megatron-core==$v" torch==2.13.0 psutil
  "$VENV/bin/python" -c 'import megatron.core as m, torch; print(f"[check] megatron-core {m.__version__}, torch {torch.__version__}")'
  CI=true PYTHONPATH=$ROOT "$VENV/bin/python" -m pytest -q -s -p no:cacheprovider \
    tests/mpi/test_megatron.py tests/unit/test_convert.py tests/e2e/test_run.py -k "megatron or convert"
  echo "[check] megatron-core $v: all checks passed"
done
