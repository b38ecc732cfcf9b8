"""Slurm job scripts as pure functions of the config (checked against golden files).

    python -m flexmarl_hpc.submit configs/local.yaml --dry-run            # prints hetjob_script(...)
    python -m flexmarl_hpc.submit configs/local.yaml --dry-run --single   # prints single_script(...)

A run is one heterogeneous job: component 0 the orchestrator (1 task), component 1 the
rollout pool (rollout.replicas tasks), component 2 the trainer groups (groups x
ranks_per_group tasks); with `rollout.pools` / `trainer.named_groups` one component per
pool and per group, in that order, and with `tools.ranks` the tool ranks last (CPU only,
slurm.tools) (flexmarl_hpc.config.resources.components). One het step (`srun --het-group=0 ... : --het-group=1 ... :
--het-group=2 ...`, each component with its own --cpus-per-task) starts every rank in one
MPI_COMM_WORLD; SLURM_PROCID counts across components in that order, which is the rank
order of flexmarl_hpc.config.layout. Replica components bind one block of GPUs per task
(--gpus-per-task); trainer components ask --gpus-per-node and leave every GPU of the node
visible to each rank, as does `single_script` (roles share nodes): flexmarl_hpc.runtime.devices
gives each rank its own. Every component gets a --mem (resources.component_mem). submitit
cannot write het jobs (its issue 1741), so the text is ours; `single_script` is the one-allocation variant for sites without het jobs.

Preemption and resume. `--signal=USR1@N` makes Slurm send SIGUSR1 to every task of every
component N seconds before the time limit; preemption (PreemptMode=REQUEUE with a
GraceTime) sends SIGTERM to the tasks. Either way the ranks checkpoint every agent, flush
the store and exit 75; the script then runs `scontrol requeue`, and the requeued job
(SLURM_RESTART_COUNT > 0) resumes from run.output_dir. Slurm holds a requeued job for
the credential lifetime (AuthInfo cred_expire, 120 s by default) and sets that hold when
the job has fully ended, i.e. after this script is gone: nothing inside the job can
shorten it. `SlurmRun.wait()` (submit --wait) releases it from outside.

The scripts check the `slurm:` section first (flexmarl_hpc.config.validate_slurm);
`check_capacity` (flexmarl_hpc.launch.preflight) compares it with what the partitions offer.
Everything here is pure and needs no Slurm.
"""
from __future__ import annotations

import math
import shlex

from flexmarl_hpc.config.layout import ROLLOUT, TRAINER
from flexmarl_hpc.config.plan import Plan
from flexmarl_hpc.config.resources import component_mem
from flexmarl_hpc.config.schema import Config, SlurmComponent
from flexmarl_hpc.config.validate_slurm import OPTION_RE, check_gpus, validate_slurm
from flexmarl_hpc.runtime.requeue import ENV as REQUEUE_FILE_ENV
from flexmarl_hpc.runtime.requeue import ERROR_ENV as ERROR_FILE_ENV
from flexmarl_hpc.runtime.requeue import EXIT_REQUEUE
from flexmarl_hpc.runtime.stale_shm import INCARNATION_ENV
COMPONENTS = ("orchestrator", "rollout", "trainer")
"""Het components in rank order."""


def sbatch_option_items(options: list[str]) -> dict[str, object]:
    """['--constraint=a100', '--exclusive'] -> {'constraint': 'a100', 'exclusive': True}
    (submitit's additional_parameters; it writes True as a bare flag)."""
    return {m.group(1): m.group(2) or True for m in map(OPTION_RE.match, options)}



# ---------------------------------------------------------------------------------------
# script text
# ---------------------------------------------------------------------------------------
def _escape_pattern(path: str) -> str:
    # sbatch expands %j, %x, ... in --output/--error; a literal % must be written %%
    return path.replace("%", "%%")


def _job_wide(cfg: Config) -> list[str]:
    """Options of the whole job. In a het job Slurm copies them from component 0 to the
    others (measured on 22.05: name, time, QOS, requeue, and --signal reaches the tasks
    of every component; --account per the Slurm docs)."""
    s = cfg.slurm
    logs = _escape_pattern(str(cfg.output_dir / "logs"))
    lines = [f"#SBATCH --job-name={cfg.run.name}", f"#SBATCH --time={s.time}"]
    lines += [f"#SBATCH --{k}={getattr(s, k)}" for k in ("account", "qos") if getattr(s, k)]
    lines += [f"#SBATCH --output={logs}/%j.out", f"#SBATCH --error={logs}/%j.err",
              "#SBATCH --open-mode=append"]   # a requeued job continues the same two files
    if s.signal_seconds:
        lines.append(f"#SBATCH --signal=USR1@{s.signal_seconds}")
    lines.append("#SBATCH --requeue" if s.requeue else "#SBATCH --no-requeue")
    return lines + [f"#SBATCH {opt}" for opt in s.sbatch_options]


def _component(comp: SlurmComponent, ntasks: int, default_partition: str, label: str, mem: str,
               gpus_per_task: int = 0) -> list[str]:
    """One component's options. `gpus_per_task` > 0 (a replica component): Slurm gives each
    task its own block (--gpus-per-task binds it to the task); 0 (trainer ranks, --single):
    --gpus-per-node, every task sees its node's GPUs and flexmarl_hpc.runtime.devices gives
    each rank its own. `mem`: the resolved --mem (resources.component_mem)."""
    lines = [f"#SBATCH --nodes={comp.nodes}".ljust(36) + f"# {label}",
             f"#SBATCH --ntasks={ntasks}", f"#SBATCH --ntasks-per-node={math.ceil(ntasks / comp.nodes)}",
             f"#SBATCH --cpus-per-task={comp.cpus_per_task}"]
    if comp.gpus_per_node and gpus_per_task:
        lines.append(f"#SBATCH --gpus-per-task={gpus_per_task}")
    elif comp.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={comp.gpus_per_node}")
    lines.append(f"#SBATCH --mem={mem}")
    if comp.partition or default_partition:
        lines.append(f"#SBATCH --partition={comp.partition or default_partition}")
    return lines + [f"#SBATCH {opt}" for opt in comp.sbatch_options]


def _body(cfg: Config, srun: str, python: str, config_path: str, overrides: list[str]) -> list[str]:
    """`srun` contains {cmd} where the rank command goes ("${CMD[@]}")."""
    cmd = " ".join(shlex.quote(a) for a in [python, "-m", "flexmarl_hpc.run", config_path, *overrides])
    env = [f"export {k}={shlex.quote(v)}" for k, v in cfg.slurm.env.items()]
    lines = ["", "# site set-up (slurm.setup)", *(cfg.slurm.setup or [":"]), "",
             *(["# every rank's environment (slurm.env)", *env] if env else []),
             "export PYTHONUNBUFFERED=1",
             *incarnation_lines(),
             "# SIGUSR1 (--signal, or `scancel --signal=USR1 --full`) and SIGTERM (preemption) are",
             "# for the ranks: they checkpoint and exit 75. bash would die of them; trapped, it waits",
             "# for srun and requeues.",
             "trap 'echo \"flexmarl_hpc: batch shell got SIGUSR1\"' USR1",
             "trap 'echo \"flexmarl_hpc: batch shell got SIGTERM\"' TERM",
             'echo "flexmarl_hpc: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $(hostname) at $(date -Is)"',
             # no --kill-on-bad-exit: after a preemption signal the orchestrator exits 75 a moment
             # before the workers and srun would turn that into 143; a failing rank calls
             # MPI_Abort, which ends the whole step anyway
             f"CMD=({cmd})",
             *_restart_gate(cfg),
             *_started_file(cfg),
             srun.format(cmd='"${CMD[@]}"') + " &",
             "SRUN=$!",
             *_start_watchdog(cfg.slurm.start_timeout),
             *_wait_srun(),
             'echo "flexmarl_hpc: ranks exited $rc at $(date -Is)$([ "$rc" = "$s" ] || echo " (srun: $s)")"',
             f"if [ $rc -eq {EXIT_REQUEUE} ]; then"]
    if cfg.slurm.requeue:
        lines += [*_count_restart(cfg),
            "  # The requeue ends this script. Slurm then holds the job for the credential lifetime",
            "  # (cred_expire, 120 s by default) from the moment it has ended, so only a client can",
            "  # release it early: `submit --wait` does, or scontrol update jobid=J StartTime=now.",
            '  echo "flexmarl_hpc: exit 75 ($cause): requeueing"',
            '  scontrol requeue "$SLURM_JOB_ID" || echo "flexmarl_hpc: requeue refused '
            '(a preempted job is requeued by Slurm itself)"']
    else:
        lines.append('  echo "flexmarl_hpc: checkpointed; slurm.requeue is off: submit again to resume"')
    return lines + ["fi", "exit $rc", ""]


def incarnation_lines() -> list[str]:
    """One name for this start of the job, the same on every node and het component, which
    srun hands to each task: the ranks clear what a killed start left in /dev/shm once per
    start (runtime/stale_shm.py). The job id and restart count alone come round again."""
    return ["# one name for this start of the job on every node and het component: the ranks clear",
            "# what a killed start left in /dev/shm once per start (runtime/stale_shm.py)",
            f'export {INCARNATION_ENV}="$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}.$(date +%s%N)"']


def _restart_gate(cfg: Config) -> list[str]:
    """slurm.max_restarts: the count of requeues in a row that ended without a new checkpoint
    lives in logs/JOB.restarts ("COUNT CAUSE", written by `_count_restart`). An incarnation
    that finds it over the bound does not start: Slurm requeues a preempted job by itself,
    past this script's own decision. `CKPT` is what every agent's `latest` names now."""
    if not cfg.slurm.requeue:
        return []
    logs = shlex.quote(str(cfg.output_dir / "logs"))
    ckpts = shlex.quote(str(cfg.output_dir / "checkpoints"))
    return ["# restart bound (slurm.max_restarts): requeues in a row without a new checkpoint",
            f'RESTARTS={logs}/"$SLURM_JOB_ID.restarts"',
            f"ckpt_sig() {{ cat {ckpts}/*/latest 2>/dev/null | cksum; }}",
            'CKPT=$(ckpt_sig)',
            '{ read -r nfail cause < "$RESTARTS"; } 2>/dev/null || nfail=0   # braces: no file yet (the first start) prints nothing',
            f'if [ "$nfail" -gt {cfg.slurm.max_restarts} ]; then',
            *_stop_line(cfg, "not starting"),
            "  exit 1",
            "fi"]


def _count_restart(cfg: Config) -> list[str]:
    """Inside `if [ $rc -eq 75 ]`: name the cause, count this incarnation if no agent
    checkpointed during it (0 if one did), and stop instead of requeueing past the bound."""
    return ['  cause="checkpointed after a preemption signal"',
            f'  [ ! -e "${REQUEUE_FILE_ENV}" ] || cause=$(head -c 300 "${REQUEUE_FILE_ENV}")',
            '  [ ! -e "$FLEXMARL_STARTED_FILE.timeout" ] || cause="the ranks were not through MPI '
            f'start-up after {cfg.slurm.start_timeout} s (slurm.start_timeout)"',
            '  if [ "$(ckpt_sig)" = "$CKPT" ]; then nfail=$((nfail + 1)); else nfail=0; fi',
            '  echo "$nfail $cause" > "$RESTARTS"',
            f'  if [ "$nfail" -gt {cfg.slurm.max_restarts} ]; then',
            *(" " * 2 + line for line in _stop_line(cfg, "not requeueing")),
            "    exit 1",
            "  fi"]


def _stop_line(cfg: Config, what: str) -> list[str]:
    return [f'  echo "flexmarl_hpc: {what}: $nfail incarnations in a row ended without a new checkpoint '
            f'(slurm.max_restarts={cfg.slurm.max_restarts}), the last: $cause. Fix that, then submit the '
            'same command to resume."']


def _started_file(cfg: Config) -> list[str]:
    """The files through which the ranks tell the batch script, one pair per incarnation of
    the job: rank 0 that start-up is over (ranks/job.py, hold_run_lock), and any rank that it
    ends the job for a requeue, and why (runtime/requeue.py)."""
    logs = shlex.quote(str(cfg.output_dir / "logs"))
    return ["# rank 0 creates it once every rank is through MPI start-up (MPI_Init, the run lock)",
            f'export FLEXMARL_STARTED_FILE={logs}/"$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}.started"',
            "# a rank that ends the job for a requeue (a lost or hung rank) writes the cause here:",
            "# srun reports the other tasks' SIGKILL (137), not the rank's 75; one that ends it for",
            "# a genuine error says so in the second file",
            f'export {REQUEUE_FILE_ENV}={logs}/"$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}.requeue"',
            f'export {ERROR_FILE_ENV}={logs}/"$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}.error"',
            f'rm -f "$FLEXMARL_STARTED_FILE" "$FLEXMARL_STARTED_FILE.timeout" "${REQUEUE_FILE_ENV}" "${ERROR_FILE_ENV}"']


def _start_watchdog(seconds: int) -> list[str]:
    """A rank stuck in MPI_Init (a PMI exchange that hangs: docs/slurm.md, 'MPI start-up')
    holds the allocation to its time limit: after `seconds` without the started file the
    step is ended and the job requeued (Slurm's MaxBatchRequeue bounds the retries). It
    looks once a second and leaves as soon as the file is there or srun has ended."""
    if not seconds:
        return []
    return ["# MPI start-up watchdog (slurm.start_timeout)",
            f"( for _ in $(seq {seconds}); do",
            '    [ -e "$FLEXMARL_STARTED_FILE" ] && exit 0; kill -0 $SRUN 2>/dev/null || exit 0; sleep 1',
            "  done",
            f'  echo "flexmarl_hpc: the ranks were not through MPI start-up after {seconds} s '
            '(slurm.start_timeout): ending the step to requeue"',
            '  touch "$FLEXMARL_STARTED_FILE.timeout"; kill -TERM $SRUN ) &']


def _wait_srun() -> list[str]:
    """Wait for srun in the background: a trapped USR1/TERM ends `wait` early (status >
    128) while srun runs on; the status of srun is the one kept. Then the ranks' word
    (runtime/requeue.py) decides: a requeue file or the start-up watchdog's mark is 75; a
    step killed by a signal with neither a requeue nor an error file is a lost rank, 75."""
    return ["rc=",
            'while [ -z "$rc" ]; do',
            "  wait $SRUN; s=$?",
            "  if [ $s -gt 128 ]; then",
            "    kill -0 $SRUN 2>/dev/null && continue              # a trapped signal: srun runs on",
            "    wait $SRUN 2>/dev/null; t=$?; [ $t -eq 127 ] || s=$t  # srun ended meanwhile",
            "  fi",
            "  rc=$s",
            "done",
            f'[ ! -e "$FLEXMARL_STARTED_FILE.timeout" ] || rc={EXIT_REQUEUE}',
            "# killed by a signal and no rank said why: a rank died with no word (SIGKILL, the OOM killer,",
            "# a lost node) and the MPI runtime ended the rest before they could (Open MPI under PMIx)",
            f'if [ $rc -gt 128 ] && [ ! -e "${ERROR_FILE_ENV}" ] && [ ! -e "${REQUEUE_FILE_ENV}" ]; then',
            f'  echo "a rank was lost (srun: $s) and no rank reported an error" > "${REQUEUE_FILE_ENV}"',
            "fi",
            f'[ ! -e "${REQUEUE_FILE_ENV}" ] || rc={EXIT_REQUEUE}']


def hetjob_script(plan: Plan, config_path: str, overrides: list[str] = (), python: str = "python") -> str:
    """The sbatch text of one heterogeneous job (orchestrator, rollout pool, trainers).

    `config_path` and `overrides` are passed to `python -m flexmarl_hpc.run` unchanged
    (submit makes them absolute); `python` is the interpreter on the compute nodes.
    """
    cfg, comps = plan.cfg, plan.components
    validate_slurm(plan)
    check_gpus(plan)
    lines = ["#!/bin/bash",
             f"# flexmarl_hpc run {cfg.run.name}: one heterogeneous job, rank order = component order",
             "#   tasks: " + ", ".join(f"{i} {c.name} {c.ntasks}" for i, c in enumerate(comps)),
             *_job_wide(cfg)]
    for i, c in enumerate(comps):
        if i:
            lines.append("#SBATCH hetjob")
        lines += _component(c.slurm, c.ntasks, cfg.slurm.partition, f"component {i}: {c.name}",
                            component_mem(cfg, c), c.gpus_per_task if c.role == ROLLOUT else 0)
    # one step over every component (one MPI_COMM_WORLD, ranks in component order), each with
    # its own --cpus-per-task: since Slurm 22.05 srun does not take it from the allocation.
    # Trainer ranks see every GPU of their node (--gpu-bind=none: no per-task binding, which
    # would hide the TP peers NCCL's NVLink paths need); devices.py sets each one's device
    srun = f"srun --mpi={cfg.slurm.mpi} " + " : ".join(
        f"--het-group={i} --cpus-per-task={c.slurm.cpus_per_task}"
        f"{' --gpu-bind=none' if c.role == TRAINER and c.slurm.gpus_per_node else ''} {{cmd}}"
        for i, c in enumerate(comps))
    return "\n".join(lines + _body(cfg, srun, python, config_path, list(overrides)))


def single_script(plan: Plan, config_path: str, overrides: list[str] = (), python: str = "python") -> str:
    """One allocation of all ranks (sites without het jobs); rank order is the layout's."""
    cfg, comp, world = plan.cfg, plan.single, plan.layout.world_size
    validate_slurm(plan)
    check_gpus(plan, single=True)
    lines = ["#!/bin/bash",
             f"# flexmarl_hpc run {cfg.run.name}: one allocation of {world} tasks "
             "(rank 0 orchestrator, then rollout replicas, then trainer ranks"
             + (", then tool ranks)" if cfg.tools.ranks else ")"),
             *_job_wide(cfg),
             *_component(comp, world, cfg.slurm.partition, "all ranks", comp.mem)]
    # every role shares the nodes: Slurm cannot tell a replica from the orchestrator, so the
    # tasks see their node's GPUs and flexmarl_hpc.runtime.devices gives each GPU rank its own
    bind = " --gpu-bind=none" if comp.gpus_per_node else ""
    srun = f"srun --mpi={cfg.slurm.mpi} --ntasks={world} --cpus-per-task={comp.cpus_per_task}{bind} {{cmd}}"
    return "\n".join(lines + _body(cfg, srun, python, config_path, list(overrides)))
