#!/usr/bin/env bash
# Stop the Slurm daemons scripts/slurm_up.sh started (by PID file); leaves munge/mariadb.
cd "$(dirname "$0")/.."
P=${SLURM_PREFIX:-$PWD/.slurm-local}
for f in "$P"/slurmd-n*.pid "$P"/slurmctld.pid "$P"/slurmdbd.pid; do
  [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null
done
exit 0
