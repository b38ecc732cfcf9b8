"""Slurm job scripts as pure functions of the config (checked against golden files).

A run is one heterogeneous job: component 0 the orchestrator (1 task), component 1 the
rollout pool (rollout.replicas tasks), component 2 the trainer groups (groups x
ranks_per_group tasks). One `srun --het-group=0-2` starts every rank in one
MPI_COMM_WORLD; SLURM_PROCID counts across components in that order, which is the
order of flexmarl_hpc.layout. submitit cannot write het jobs (its issue 1741), so the text
is ours; `single_script` is the one-allocation variant for sites without het jobs.

On SIGUSR1 (`--signal=USR1@N`, N seconds before the time limit, sent to every task) or
SIGTERM the run checkpoints every agent, flushes the store and exits 75; the script then
requeues the job, and the requeued job (SLURM_RESTART_COUNT > 0) resumes from the
checkpoints and the store in run.output_dir.
"""
from __future__ import annotations

import re
import shlex

from .config import Config, ConfigError, SlurmComponent
from .layout import layout_from_config

EXIT_REQUEUE = 75
TIME_RE = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$")
MEM_RE = re.compile(r"^\d+[KMGT]?$")
MPI_PLUGINS = ("pmi2", "pmix", "pmix_v3", "pmix_v4", "none")


def validate_slurm(cfg: Config) -> None:
    """Refuse a bad `slurm:` section before anything is submitted, naming the field."""
    s = cfg.slurm
    if not TIME_RE.match(s.time):
        raise ConfigError(f"slurm.time: expected [D-]HH:MM:SS, MM:SS or minutes, got {s.time!r}")
    if s.mpi not in MPI_PLUGINS:
        raise ConfigError(f"slurm.mpi: expected one of {list(MPI_PLUGINS)}, got {s.mpi!r}")
    if s.signal_seconds < 0:
        raise ConfigError(f"slurm.signal_seconds: expected >= 0, got {s.signal_seconds}")
    tasks = dict(zip(("orchestrator", "rollout", "trainer"), layout_from_config(cfg).component_sizes))
    for name, comp in (("orchestrator", s.orchestrator), ("rollout", s.rollout), ("trainer", s.trainer)):
        where = f"slurm.{name}"
        if comp.nodes < 1:
            raise ConfigError(f"{where}.nodes: expected >= 1, got {comp.nodes}")
        if comp.nodes > tasks[name]:
            raise ConfigError(f"{where}.nodes: {comp.nodes} nodes for {tasks[name]} tasks leaves a node idle")
        if comp.gpus_per_node < 0:
            raise ConfigError(f"{where}.gpus_per_node: expected >= 0, got {comp.gpus_per_node}")
        if comp.cpus_per_task < 1:
            raise ConfigError(f"{where}.cpus_per_task: expected >= 1, got {comp.cpus_per_task}")
        if comp.mem and not MEM_RE.match(comp.mem):
            raise ConfigError(f"{where}.mem: expected a size like 64G or 4000M, got {comp.mem!r}")


def _component(comp: SlurmComponent, ntasks: int, cfg: Config) -> list[str]:
    s = cfg.slurm
    lines = [f"#SBATCH --nodes={comp.nodes}", f"#SBATCH --ntasks={ntasks}",
             f"#SBATCH --cpus-per-task={comp.cpus_per_task}"]
    if comp.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={comp.gpus_per_node}")
    if comp.mem:
        lines.append(f"#SBATCH --mem={comp.mem}")
    if comp.partition or s.partition:
        lines.append(f"#SBATCH --partition={comp.partition or s.partition}")
    return lines


def _header(cfg: Config) -> list[str]:
    s, out = cfg.slurm, cfg.output_dir
    lines = [f"#SBATCH --job-name={cfg.run.name}", f"#SBATCH --time={s.time}",
             f"#SBATCH --output={out}/logs/%j.out", f"#SBATCH --error={out}/logs/%j.err",
             "#SBATCH --open-mode=append"]
    if s.account:
        lines.append(f"#SBATCH --account={s.account}")
    if s.qos:
        lines.append(f"#SBATCH --qos={s.qos}")
    if s.signal_seconds:
        lines.append(f"#SBATCH --signal=USR1@{s.signal_seconds}")
    lines.append("#SBATCH --requeue" if s.requeue else "#SBATCH --no-requeue")
    return lines


# No --kill-on-bad-exit: after a preemption signal the orchestrator exits 75 a moment
# before the workers, and srun would turn that into 143 (Terminated). A rank that fails
# calls MPI_Abort, which ends the whole step anyway.
def _body(cfg: Config, srun: str, python: str, config_path: str, overrides: list[str]) -> list[str]:
    args = " ".join(shlex.quote(a) for a in [config_path, *overrides])
    lines = ["", "# site set-up (slurm.setup)"] + (cfg.slurm.setup or [":"]) + [
        "",
        "export PYTHONUNBUFFERED=1",
        'echo "flexmarl_hpc: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $(hostname)"',
        f"{srun} {shlex.quote(python)} -m flexmarl_hpc.run {args}",
        "rc=$?",
        f"if [ $rc -eq {EXIT_REQUEUE} ]; then",
        '  echo "flexmarl_hpc: checkpointed after a preemption signal; requeueing"',
    ]
    if cfg.slurm.requeue:
        lines.append("  scontrol requeue \"$SLURM_JOB_ID\"")
    lines += ["fi", "exit $rc", ""]
    return lines


def hetjob_script(cfg: Config, config_path: str, overrides: list[str] = (), python: str = "python") -> str:
    """The sbatch text of one heterogeneous job (orchestrator, rollout pool, trainers)."""
    validate_slurm(cfg)
    sizes = layout_from_config(cfg).component_sizes
    comps = (cfg.slurm.orchestrator, cfg.slurm.rollout, cfg.slurm.trainer)
    lines = ["#!/bin/bash", f"# flexmarl_hpc run {cfg.run.name}: het job, components "
             f"orchestrator={sizes[0]} rollout={sizes[1]} trainer={sizes[2]} tasks"]
    lines += _header(cfg)
    for i, (comp, n) in enumerate(zip(comps, sizes)):
        if i:
            lines.append("#SBATCH hetjob")
        lines += _component(comp, n, cfg)
    srun = f"srun --mpi={cfg.slurm.mpi} --het-group=0-2"
    return "\n".join(lines + _body(cfg, srun, python, config_path, list(overrides)))


def single_script(cfg: Config, config_path: str, overrides: list[str] = (), python: str = "python") -> str:
    """One allocation of all ranks (sites without het jobs): rank order = the layout's."""
    validate_slurm(cfg)
    world = layout_from_config(cfg).world_size
    comp = cfg.slurm.trainer
    lines = ["#!/bin/bash", f"# flexmarl_hpc run {cfg.run.name}: one allocation of {world} tasks"]
    lines += _header(cfg) + _component(SlurmComponent(
        nodes=max(cfg.slurm.orchestrator.nodes, cfg.slurm.rollout.nodes, comp.nodes),
        gpus_per_node=max(cfg.slurm.rollout.gpus_per_node, comp.gpus_per_node),
        cpus_per_task=comp.cpus_per_task, mem=comp.mem, partition=comp.partition), world, cfg)
    srun = f"srun --mpi={cfg.slurm.mpi} --ntasks={world}"
    return "\n".join(lines + _body(cfg, srun, python, config_path, list(overrides)))
