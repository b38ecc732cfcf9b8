#!/usr/bin/env bash
# Set up (idempotent) and run the test suite (what CI runs):
#   bash scripts/test.sh [pytest args...]
# Tests that need MPI, Slurm or HDF5 fail under CI=true when those are missing; Slurm tests
# bring up a local Slurm cluster themselves (scripts/slurm_up.sh, needs root for apt).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" = 5 ]; then
  echo "[test] pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
