#!/usr/bin/env bash
# Stop the local Slurm cluster of scripts/slurm_up.sh, by PID file (never by name).
#   bash scripts/slurm_down.sh          # slurmd x N, slurmctld, slurmdbd
#   bash scripts/slurm_down.sh --all    # also its MariaDB, and munged if slurm_up.sh started it
#   bash scripts/slurm_down.sh --orphans  # daemons of a clone deleted while its cluster ran
# State (.slurm-local/: spool, logs, job records, database) stays: slurm_up.sh brings the
# queue back as it was.
cd "$(dirname "$0")/.."
P=${SLURM_PREFIX:-$PWD/.slurm-local}
if [ "${1:-}" = "--orphans" ]; then
  # Their PID files went with the clone; what marks them is a log or data file they still
  # hold open under a .slurm-local/ folder that no longer exists. Nothing else is touched.
  pids=()
  for pid in $(for d in slurmctld slurmd slurmdbd mariadbd; do pgrep -x "$d" || true; done); do
    ls -l "/proc/$pid/fd" 2>/dev/null | grep -q '/\.slurm-local/.*(deleted)' && pids+=("$pid")
  done
  [ ${#pids[@]} -gt 0 ] && { echo "[slurm_down] orphans: $(ps -o pid=,comm= -p "${pids[@]}" | xargs)"; kill -9 "${pids[@]}"; }
  echo "[slurm_down] stopped ${#pids[@]} orphaned daemons"
  exit 0
fi
files=("$P"/slurmd-n*.pid "$P/slurmctld.pid" "$P/slurmdbd.pid")
if [ "${1:-}" = "--all" ]; then
  files+=("$P/mariadb.pid")
  [ -f "$P/munge.started" ] && files+=(/run/munge/munged.pid) && rm -f "$P/munge.started"
fi
pids=()
for f in "${files[@]}"; do
  [ -f "$f" ] && pid=$(cat "$f") && kill -0 "$pid" 2>/dev/null && kill "$pid" && pids+=("$pid")
done
# SIGTERM, 10 s grace, then SIGKILL: a slurmd still retrying a lost controller ignores TERM
for _ in $(seq 1 100); do
  left=(); for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && left+=("$pid"); done
  [ ${#left[@]} = 0 ] && break; sleep 0.1
done
for pid in "${left[@]}"; do echo "[slurm_down] $pid ignored SIGTERM for 10 s: SIGKILL" >&2; kill -9 "$pid"; done
echo "[slurm_down] stopped ${#pids[@]} daemons"
exit 0
