#!/usr/bin/env bash
# A real single-host Slurm 22.05 (Debian packages) as 4 virtual nodes, for tests and CI:
#   sudo bash scripts/slurm_up.sh      # idempotent: returns at once when it is already up
#   bash scripts/slurm_down.sh         # stops the daemons it started
# Het jobs need one node per component, so several slurmd run on this host (NodeHostname,
# Port range, %n paths, SlurmdParameters=config_overrides to declare more CPUs than exist).
# slurmdbd + MariaDB make sacct work (job states after the fact). Two partitions of
# different PriorityTier with preempt/partition_prio + REQUEUE give real preemption.
set -euo pipefail
cd "$(dirname "$0")/.."
P=${SLURM_PREFIX:-$PWD/.slurm-local}; NN=${SLURM_NNODES:-4}; CPUS=${SLURM_NODE_CPUS:-4}; MEM=${SLURM_NODE_MEM:-4000}
if sinfo -h -o %D >/dev/null 2>&1 && [ -f "$P/slurmctld.pid" ] && kill -0 "$(cat "$P/slurmctld.pid")" 2>/dev/null; then
  echo "[slurm_up] already up"; sinfo; exit 0
fi
[ "$(id -u)" = 0 ] || { echo "[slurm_up] needs root (apt, munge, slurmd as root)" >&2; exit 1; }
WITH_DBD=${WITH_DBD:-1}; H=$(hostname -s); export DEBIAN_FRONTEND=noninteractive
t0=$(date +%s.%N); lap(){ echo "[slurm_up] $1: $(echo "$(date +%s.%N)-$t0"|bc) s"; }
PKGS="slurmctld slurmd slurm-client munge"; [ "$WITH_DBD" = 1 ] && PKGS="$PKGS slurmdbd mariadb-server"
need=0; for b in slurmctld slurmd sinfo munged; do command -v $b >/dev/null || need=1; done
[ "$WITH_DBD" = 1 ] && { command -v slurmdbd >/dev/null && command -v mysqld_safe >/dev/null || need=1; }
if [ $need = 1 ]; then apt-get update -qq; apt-get install -y -qq --no-install-recommends $PKGS >/dev/null; fi; lap apt
grep -qw "$H" /etc/hosts || echo "127.0.0.1 $H" >> /etc/hosts
mkdir -p $P/spool/ctld $P/log; for i in $(seq 1 $NN); do mkdir -p $P/spool/d-n$i $P/tmpfs/n$i; done
mkdir -p /run/munge && chown munge:munge /run/munge
pgrep -u munge -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
ACCT="AccountingStorageType=accounting_storage/none"
if [ "$WITH_DBD" = 1 ]; then
  mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
  mysqladmin ping >/dev/null 2>&1 || { (setsid mysqld_safe --user=mysql >$P/log/mysqld_safe.log 2>&1 &); }
  for i in $(seq 1 150); do mysqladmin ping >/dev/null 2>&1 && break; sleep 0.2; done
  mysql -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db; CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurmpw'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
  cat > /etc/slurm/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
LogFile=$P/log/slurmdbd.log
PidFile=$P/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurmpw
StorageLoc=slurm_acct_db
EOF
  chmod 600 /etc/slurm/slurmdbd.conf; pgrep -x slurmdbd >/dev/null || slurmdbd
  ACCT=$'AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1'
fi
cat > /etc/slurm/slurm.conf <<EOF
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
NodeName=n[1-$NN] NodeHostname=$H NodeAddr=127.0.0.1 Port=[17001-$((17000+NN))] CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=n[1-$NN] Default=YES MaxTime=INFINITE DefMemPerCPU=250 PriorityTier=1 State=UP
PartitionName=high Nodes=n[1-$NN] MaxTime=INFINITE DefMemPerCPU=250 PriorityTier=10 State=UP
EOF
if [ "$WITH_DBD" = 1 ]; then for i in $(seq 1 300); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.2; done; fi
lap "munge/db up"
pgrep -x slurmctld >/dev/null || slurmctld
for i in $(seq 1 $NN); do pgrep -f "slurmd -N n$i\$" >/dev/null || slurmd -N n$i; done
for i in $(seq 1 200); do [ "$(sinfo -h -p debug -t idle -o %D 2>/dev/null)" = "$NN" ] && break; sleep 0.25; done
sinfo; lap "slurm up"
