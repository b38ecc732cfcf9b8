#!/usr/bin/env bash
# A real Slurm 22.05 (Debian packages) on this one host, as 8 virtual nodes, for tests and CI.
#
#   sudo bash scripts/slurm_up.sh     # ~10 s on a fresh machine (apt-get ~7 s of it); <0.1 s when up
#   bash scripts/slurm_down.sh        # stops the Slurm daemons (--all: its MariaDB, munged too)
#
# Idempotent: when the daemons run with this very configuration it only checks the nodes;
# when the configuration changed it rewrites it and restarts the Slurm daemons.
# What it sets up, and why:
# - het jobs need one node per component, so NNODES slurmd run on this host (NodeHostname,
#   a Port range, %n in the spool/log/pid paths, `slurmd -N nX`); each declares CPUS CPUs,
#   more than the host has (SlurmdParameters=config_overrides), so training ranks fit;
# - munge for authentication (a munged already running is used); slurmdbd + a private
#   MariaDB (datadir, socket and port 13306 under the state dir) so sacct knows finished
#   jobs: submitit and flexmarl_hpc.submit read job states from it;
# - two partitions over the same nodes: `debug` (default, PriorityTier=1, GraceTime=30) and
#   `high` (PriorityTier=10); PreemptType=preempt/partition_prio + PreemptMode=REQUEUE, so a
#   `high` job preempts: the debug job's tasks get SIGTERM, 30 s to checkpoint, then requeue;
# - backfill every second with bf_hetjob_immediate (het jobs are only started by backfill);
#   AuthInfo=cred_expire=10: a requeued job is held 10 s instead of 120 s;
# - a `gpu` partition of GPU_NODES (48) nodes x 16 GPUs as GRES (the paper's testbed), so
#   `sbatch --test-only` can judge a full-size job script: the nodes are State=CLOUD (powered
#   down until a job wants them; Resume/SuspendProgram are /bin/true), which the scheduler
#   counts as available, and no slurmd runs for them. A GRES count needs no devices: the
#   controller takes `Gres=gpu:16` from slurm.conf (gres.conf AutoDetect=off, no File=).
#   PrivateData=cloud makes sinfo list them (powered-down cloud nodes are hidden otherwise).
#   Jobs are only ever *tested* there: one started on them would wait for a node that never boots.
# Environment: SLURM_PREFIX (state dir, default REPO/.slurm-local), SLURM_NNODES (8),
# SLURM_NODE_CPUS (4), SLURM_NODE_MEM (MB, 4000), WITH_DBD (1).
set -euo pipefail
cd "$(dirname "$0")/.."
P=${SLURM_PREFIX:-$PWD/.slurm-local}; NN=${SLURM_NNODES:-8}; CPUS=${SLURM_NODE_CPUS:-4}
MEM=${SLURM_NODE_MEM:-4000}; WITH_DBD=${WITH_DBD:-1}; H=$(hostname -s); GN=${GPU_NODES:-48}
DBDIR=$P/mariadb; DBPORT=${SLURM_DB_PORT:-13306}
CONF=/etc/slurm/slurm.conf
t0=$(date +%s.%N); lap(){ echo "[slurm_up] $1: $(printf '%.1f' "$(echo "$(date +%s.%N) - $t0" | bc)") s"; }
alive(){ [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }      # alive PIDFILE
# until SECONDS CMD...: retry CMD (each try bounded to 5 s) for up to SECONDS
until_ok(){ local end=$((SECONDS + $1)); shift
  until timeout 5 "$@" >/dev/null 2>&1; do [ $SECONDS -ge $end ] && return 1; sleep 0.2; done; }
munge_ok(){ command -v munge >/dev/null && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

if [ "$WITH_DBD" = 1 ]; then
  ACCT=$'AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1'
else
  ACCT="AccountingStorageType=accounting_storage/none"
fi
slurm_conf() {
cat <<EOF
# written by scripts/slurm_up.sh (flexmarl_hpc local test cluster); edits are overwritten
ClusterName=flexmarl
SlurmctldHost=$H(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
StateSaveLocation=$P/spool/ctld
SlurmdSpoolDir=$P/spool/d-%n
SlurmctldPidFile=$P/slurmctld.pid
SlurmdPidFile=$P/slurmd-%n.pid
SlurmctldLogFile=$P/log/slurmctld.log
SlurmdLogFile=$P/log/slurmd-%n.log
TmpFS=$P/tmpfs/%n
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
$ACCT
JobCompType=jobcomp/filetxt
JobCompLoc=$P/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,bf_hetjob_immediate
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
MailProg=/bin/true
KillWait=5
MinJobAge=300
InactiveLimit=0
GresTypes=gpu
PrivateData=cloud
SuspendProgram=/bin/true
ResumeProgram=/bin/true
SuspendExcNodes=n[1-$NN]
ResumeTimeout=600
NodeName=n[1-$NN] NodeHostname=$H NodeAddr=127.0.0.1 Port=[17001-$((17000 + NN))] CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=n[1-$NN] Default=YES MaxTime=INFINITE DefMemPerCPU=250 PriorityTier=1 GraceTime=30 State=UP
PartitionName=high Nodes=n[1-$NN] MaxTime=INFINITE DefMemPerCPU=250 PriorityTier=10 State=UP
NodeName=g[1-$GN] CPUs=64 Boards=1 SocketsPerBoard=2 CoresPerSocket=32 ThreadsPerCore=1 RealMemory=1024000 Gres=gpu:16 State=CLOUD
PartitionName=gpu Nodes=g[1-$GN] MaxTime=INFINITE State=UP
EOF
}

daemons_up() {
  alive "$P/slurmctld.pid" || return 1
  for i in $(seq 1 "$NN"); do alive "$P/slurmd-n$i.pid" || return 1; done
  [ "$WITH_DBD" = 1 ] && { alive "$P/slurmdbd.pid" && alive "$P/mariadb.pid" || return 1; }
  munge_ok
}
nodes_ready() {      # every node idle, mixed or allocated (not down, drained or unknown)
  local ok
  ok=$(timeout 10 sinfo -h -N -p debug -o '%t' 2>/dev/null | grep -cE '^(idle|mix|alloc|comp)$' || true)
  [ "$ok" = "$NN" ]
}

# fast path: already up with this configuration
if [ -f "$CONF" ] && [ "$(slurm_conf)" = "$(cat "$CONF")" ] && daemons_up && nodes_ready; then
  echo "[slurm_up] already up ($NN nodes, $CONF unchanged)"; sinfo; exit 0
fi
[ "$(id -u)" = 0 ] || { echo "[slurm_up] needs root (apt, munge, slurmd run as root)" >&2; exit 1; }
# Daemons of another state dir (another clone's cluster, or one whose clone was deleted while
# it ran) hold the ports this one needs: name them instead of failing later on a busy port.
ours=" $( (cat "$P"/*.pid 2>/dev/null || true) | xargs) "
foreign=$(for pid in $(for d in slurmctld slurmd slurmdbd; do pgrep -x "$d" || true; done); do
  [[ "$ours" == *" $pid "* || "$(ps -o stat= -p "$pid" || true)" == Z* ]] || echo "$pid"; done | xargs)
if [ -n "$foreign" ]; then
  echo "[slurm_up] slurm daemons of another cluster are running: $(ps -o pid=,args= -p "${foreign// /,}" | head -5 | tr -s ' \n' ' ')" >&2
  echo "[slurm_up] stop them first: 'bash scripts/slurm_down.sh --all' in their clone, or" \
       "'bash scripts/slurm_down.sh --orphans' here if that clone was deleted" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive

# mariadb-server-core, not mariadb-server: the daemon without a system service to start
PKGS="slurmctld slurmd slurm-client munge bc"; [ "$WITH_DBD" = 1 ] && PKGS="$PKGS slurmdbd mariadb-server-core mariadb-client"
missing=""; for pkg in $PKGS; do dpkg -s "$pkg" >/dev/null 2>&1 || missing="$missing $pkg"; done
if [ -n "$missing" ]; then
  command -v apt-get >/dev/null || { echo "[slurm_up] missing$missing and no apt-get" >&2; exit 1; }
  apt-get update -qq && apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
lap "packages"

grep -qw "$H" /etc/hosts || echo "127.0.0.1 $H" >> /etc/hosts
mkdir -p "$P/spool/ctld" "$P/log"
for i in $(seq 1 "$NN"); do mkdir -p "$P/spool/d-n$i" "$P/tmpfs/n$i"; done
if [ ! -f "$CONF" ] || [ "$(slurm_conf)" != "$(cat "$CONF")" ]; then
  # a changed node or partition list needs fresh daemons (scontrol reconfigure cannot add nodes)
  bash scripts/slurm_down.sh >/dev/null
  slurm_conf > "$CONF"
  printf 'AutoDetect=off\nNodeName=g[1-%s] Name=gpu Count=16\n' "$GN" > /etc/slurm/gres.conf
  echo "[slurm_up] wrote $CONF"
fi
mkdir -p /run/munge && chown munge:munge /run/munge
if ! munge_ok; then
  # (a munged whose socket was removed, e.g. by reinstalling munge, cannot serve: start one)
  runuser -u munge -- /usr/sbin/munged --force; touch "$P/munge.started"
  until_ok 10 munge -n || { echo "[slurm_up] munged does not answer" >&2; exit 1; }
fi

if [ "$WITH_DBD" = 1 ]; then
  # a private MariaDB: datadir, socket and port of its own under $P, so a system MariaDB
  # (if any) is neither used nor disturbed, and slurm_down.sh stops exactly this one
  SQL=(mariadb --no-defaults --socket="$DBDIR/mysqld.sock" -uroot)
  if ! alive "$P/mariadb.pid"; then
    if [ ! -d "$DBDIR/data/mysql" ]; then
      mkdir -p "$DBDIR/data"
      mariadb-install-db --no-defaults --user=root --datadir="$DBDIR/data" \
        --auth-root-authentication-method=socket >"$P/log/mariadb-install.log" 2>&1
    fi
    (setsid mariadbd --no-defaults --user=root --datadir="$DBDIR/data" --socket="$DBDIR/mysqld.sock" \
       --port="$DBPORT" --bind-address=127.0.0.1 --pid-file="$P/mariadb.pid" \
       --log-error="$P/log/mariadb.log" </dev/null >/dev/null 2>&1 &)
  fi
  until_ok 30 "${SQL[@]}" -e "SELECT 1" || { echo "[slurm_up] MariaDB does not start (port $DBPORT taken? an orphan of a deleted clone: bash scripts/slurm_down.sh --orphans):" >&2; tail -n 20 "$P/log/mariadb.log" >&2; exit 1; }
  "${SQL[@]}" -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpw';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
  cat > /etc/slurm/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
LogFile=$P/log/slurmdbd.log
PidFile=$P/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DBPORT
StorageUser=slurm
StoragePass=slurmpw
StorageLoc=slurm_acct_db
EOF
  chmod 600 /etc/slurm/slurmdbd.conf
  alive "$P/slurmdbd.pid" || slurmdbd
  until_ok 30 sacctmgr -n list cluster || { echo "[slurm_up] slurmdbd does not answer:" >&2; tail -n 20 "$P/log/slurmdbd.log" >&2; exit 1; }
fi
lap "munge + accounting"

alive "$P/slurmctld.pid" || slurmctld
for i in $(seq 1 "$NN"); do alive "$P/slurmd-n$i.pid" || slurmd -N "n$i"; done
end=$((SECONDS + 60)); until nodes_ready || [ $SECONDS -ge $end ]; do sleep 0.25; done
if ! nodes_ready; then
  echo "[slurm_up] nodes not ready after 60 s:" >&2; sinfo -N >&2 || true
  tail -n 20 "$P/log/slurmctld.log" >&2 || true; exit 1
fi
sinfo; lap "slurm up"
