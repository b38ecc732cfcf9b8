#!/usr/bin/env bash
# Set up (idempotent) and run the test suite (what CI runs):
#   bash scripts/test.sh [pytest args...]      # everything: tests/{unit,mpi,e2e,slurm,gpu}
#   bash scripts/test.sh tests/unit           # one tier (tests/README.md: what each needs and costs)
# Tests that need MPI, Slurm or HDF5 fail under CI=true when those are missing; Slurm tests
# bring up a local Slurm cluster themselves (scripts/slurm_up.sh, needs root for apt).
# The vLLM-CPU stage is part of the run: scripts/setup_vllm_cpu.sh builds .venv-vllm once
# (a no-op afterwards) and tests/e2e/test_vllm.py must then pass, not skip (FLEXMARL_VLLM=1).
# FLEXMARL_SKIP_VLLM=1 leaves that stage out for a quick local pass.
# The whole run (no arguments, as CI calls it) starts with `scripts/figures.py --check`: every
# simulator figure in docs/ must be what the code at HEAD makes (about 2 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
if [ "${FLEXMARL_SKIP_VLLM:-0}" != 1 ]; then
  bash scripts/setup_vllm_cpu.sh || exit 1
  export FLEXMARL_VLLM=1
fi
figures=0
if [ "$#" = 0 ]; then
  echo "[test] scripts/figures.py --check: the docs' simulator figures against the code at HEAD"
  .venv/bin/python scripts/figures.py --check || figures=1
fi
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" = 5 ]; then
  echo "[test] pytest collected no tests: failing" >&2
  exit 1
fi
if [ "$figures" != 0 ]; then
  echo "[test] docs figures drifted (above): run python scripts/figures.py --write" >&2
  [ "$rc" != 0 ] || rc=1
fi
exit "$rc"
