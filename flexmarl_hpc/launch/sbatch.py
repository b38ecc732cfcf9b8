"""Slurm job scripts as pure functions of the config (checked against golden files).

    python -m flexmarl_hpc.submit configs/local.yaml --dry-run            # prints hetjob_script(...)
    python -m flexmarl_hpc.submit configs/local.yaml --dry-run --single   # prints single_script(...)

A run is one heterogeneous job: component 0 the orchestrator (1 task), component 1 the
rollout pool (rollout.replicas tasks), component 2 the trainer groups (groups x
ranks_per_group tasks); with `rollout.pools` / `trainer.named_groups` one component per
pool and per group, in that order (flexmarl_hpc.config.resources.components). One het step (`srun --het-group=0 ... : --het-group=1 ... :
--het-group=2 ...`, each component with its own --cpus-per-task) starts every rank in one
MPI_COMM_WORLD; SLURM_PROCID counts across components in that order, which is the rank
order of flexmarl_hpc.config.layout. GPU components bind one block of GPUs per task
(--gpus-per-task); `single_script` leaves that to flexmarl_hpc.runtime.devices (roles share nodes). submitit cannot write het jobs (its issue 1741), so the text
is ours; `single_script` is the one-allocation variant for sites without het jobs.

Preemption and resume. `--signal=USR1@N` makes Slurm send SIGUSR1 to every task of every
component N seconds before the time limit; preemption (PreemptMode=REQUEUE with a
GraceTime) sends SIGTERM to the tasks. Either way the ranks checkpoint every agent, flush
the store and exit 75; the script then runs `scontrol requeue`, and the requeued job
(SLURM_RESTART_COUNT > 0) resumes from run.output_dir. Slurm holds a requeued job for
the credential lifetime (AuthInfo cred_expire, 120 s by default) and sets that hold when
the job has fully ended, i.e. after this script is gone: nothing inside the job can
shorten it. `SlurmRun.wait()` (submit --wait) releases it from outside.

`check_capacity` compares the components with what the partitions offer (from `sinfo`,
fetched by flexmarl_hpc.submit); everything here is pure and needs no Slurm.
"""
from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass

from flexmarl_hpc.config.schema import Config, ConfigError, SlurmComponent
from flexmarl_hpc.config.layout import layout_from_config
from flexmarl_hpc.config.resources import components

EXIT_REQUEUE = 75
"""EX_TEMPFAIL: the ranks checkpointed after SIGUSR1/SIGTERM; requeue the job."""
COMPONENTS = ("orchestrator", "rollout", "trainer")
"""Het components in rank order."""
MPI_PLUGINS = ("pmi2", "pmix", "pmix_v3", "pmix_v4", "pmix_v5", "cray_shasta")
"""`srun --mpi=` values a flexmarl_hpc world can start with (`srun --mpi=list` shows the site's)."""
SIGNAL_MAX_S = 65535                       # sbatch --signal=SIG@N: N is at most 65535
MEM_RE = re.compile(r"^[1-9]\d*[KMGT]?$")
NAME_RE = re.compile(r"^[A-Za-z0-9_.+-]+$")
SLURM_NAME_RE = re.compile(r"^[A-Za-z0-9_.,+@:-]*$")   # partition lists, accounts, QOS names
OPTION_RE = re.compile(r"^--([a-z][a-z0-9-]*)(?:=(\S+))?$")
OWNED_OPTIONS = {                         # sbatch options the config sets itself -> the field
    "job-name": "run.name", "output": "run.output_dir", "error": "run.output_dir",
    "time": "slurm.time", "account": "slurm.account", "qos": "slurm.qos",
    "signal": "slurm.signal_seconds", "requeue": "slurm.requeue", "no-requeue": "slurm.requeue",
    "open-mode": "nothing (append is what resume needs)", "partition": "{where}.partition",
    "nodes": "{where}.nodes", "ntasks": "the layout (rollout.replicas, trainer.*)",
    "cpus-per-task": "{where}.cpus_per_task", "gpus-per-node": "{where}.gpus_per_node",
    "mem": "{where}.mem", "het-group": "nothing (submit writes the het job)",
    "ntasks-per-node": "the layout and {where}.nodes", "gpus-per-task": "rollout.gpus_per_replica "
    "(trainer ranks: 1)", "gpu-bind": "nothing (flexmarl_hpc.runtime.devices binds by role)"}


# ---------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------
def parse_time(text: str) -> int | None:
    """Slurm `--time` in seconds (None for UNLIMITED/INFINITE); ValueError if malformed.

    Accepts what sbatch accepts: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (e.g. 90, 02:00:00, 1-12).
    """
    t = text.strip()
    if t.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", t)
    if not m:
        raise ValueError(text)
    days, a, b, c = m.groups()
    if days is not None:                          # D-H[:M[:S]]
        h, mi, s = int(a), int(b or 0), int(c or 0)
        secs = ((int(days) * 24 + h) * 60 + mi) * 60 + s
        bounded = (h < 24, mi < 60, s < 60)
    elif c is not None:                           # H:M:S
        h, mi, s = int(a), int(b), int(c)
        secs, bounded = (h * 60 + mi) * 60 + s, (mi < 60, s < 60)
    else:                                         # M or M:S
        mi, s = int(a), int(b or 0)
        secs, bounded = mi * 60 + s, (s < 60,)
    if not all(bounded) or secs <= 0:
        raise ValueError(text)
    return secs


def validate_slurm(cfg: Config) -> None:
    """Refuse a bad `slurm:` section before anything is submitted; the error names the field.

    Checks what can be told from the config alone; `check_capacity` adds what needs the
    cluster's partitions.
    """
    s = cfg.slurm
    try:
        limit = parse_time(s.time)
    except ValueError:
        raise ConfigError(f"slurm.time: expected minutes, MM:SS, HH:MM:SS or D-HH[:MM[:SS]], "
                          f"got {s.time!r}") from None
    if s.mpi not in MPI_PLUGINS:
        raise ConfigError(f"slurm.mpi: expected one of {list(MPI_PLUGINS)}, got {s.mpi!r} "
                          "(`srun --mpi=list` shows the site's plugins)")
    if not 0 <= s.signal_seconds <= SIGNAL_MAX_S:
        raise ConfigError(f"slurm.signal_seconds: expected 0..{SIGNAL_MAX_S}, got {s.signal_seconds}")
    if limit is not None and s.signal_seconds >= limit:
        raise ConfigError(f"slurm.signal_seconds: {s.signal_seconds} s before a {s.time} time limit "
                          "would signal the job as soon as it starts")
    for key in ("partition", "account", "qos"):
        if not SLURM_NAME_RE.match(getattr(s, key)):
            raise ConfigError(f"slurm.{key}: {getattr(s, key)!r} is not a Slurm name")
    if not NAME_RE.match(cfg.run.name):
        raise ConfigError(f"run.name: {cfg.run.name!r} becomes the job name and a file name: "
                          "use letters, digits and _ . + -")
    if re.search(r"[\s\"'\\]", str(cfg.output_dir)):
        raise ConfigError(f"run.output_dir: {str(cfg.output_dir)!r}: #SBATCH --output cannot carry "
                          "blanks, quotes or backslashes")
    for c in components(cfg):
        comp: SlurmComponent = c.slurm
        where = c.where
        if comp.nodes < 1:
            raise ConfigError(f"{where}.nodes: expected >= 1, got {comp.nodes}")
        if comp.nodes > c.ntasks:
            raise ConfigError(f"{where}.nodes: {comp.nodes} nodes for {c.ntasks} tasks leaves a node idle")
        if comp.gpus_per_node < 0:
            raise ConfigError(f"{where}.gpus_per_node: expected >= 0, got {comp.gpus_per_node}")
        if comp.cpus_per_task < 1:
            raise ConfigError(f"{where}.cpus_per_task: expected >= 1, got {comp.cpus_per_task}")
        if comp.mem and not MEM_RE.match(comp.mem):
            raise ConfigError(f"{where}.mem: expected a size per node like 64G or 4000M, got {comp.mem!r}")
        if not SLURM_NAME_RE.match(comp.partition):
            raise ConfigError(f"{where}.partition: {comp.partition!r} is not a Slurm name")
        check_sbatch_options(comp.sbatch_options, f"{where}.sbatch_options", where)
    check_sbatch_options(s.sbatch_options, "slurm.sbatch_options", "slurm.<component>")


def check_sbatch_options(options: list[str], field: str, where: str) -> None:
    """Each extra option is one long sbatch option without blanks, not one the config owns."""
    for opt in options:
        m = OPTION_RE.match(opt) if isinstance(opt, str) else None
        if not m:
            raise ConfigError(f"{field}: expected long sbatch options like '--constraint=a100' or "
                              f"'--exclusive' (no blanks), got {opt!r}")
        if m.group(1) in OWNED_OPTIONS:
            raise ConfigError(f"{field}: {opt!r} is set by " + OWNED_OPTIONS[m.group(1)].format(where=where))


def sbatch_option_items(options: list[str]) -> dict[str, object]:
    """['--constraint=a100', '--exclusive'] -> {'constraint': 'a100', 'exclusive': True}
    (submitit's additional_parameters; it writes True as a bare flag)."""
    return {m.group(1): m.group(2) or True for m in map(OPTION_RE.match, options)}


@dataclass(frozen=True)
class Partition:
    """What one partition offers, per node (the largest node when nodes differ)."""
    nodes: int
    cpus: int
    gpus: int = 0
    mem_mb: int = 0                           # 0: unknown


def mem_mb(size: str) -> int:
    """'64G' -> 65536; a bare number is MB, as in sbatch --mem."""
    unit = size[-1] if size[-1] in "KMGT" else "M"
    n = int(size[:-1] if size[-1] in "KMGT" else size)
    return {"K": n // 1024, "M": n, "G": n * 1024, "T": n * 1024 ** 2}[unit]


def check_capacity(cfg: Config, partitions: dict[str, Partition], default: str, single: bool = False) -> None:
    """Refuse components that no node of their partition can hold, naming the field.

    `partitions` maps partition name -> Partition (from `sinfo`), `default` is the
    cluster's default partition. Tasks are spread evenly over a component's nodes, so a
    node needs ceil(tasks / nodes) x cpus_per_task CPUs. `single`: the one allocation of
    `single_script` (its errors name the trainer fields, whose partition it uses).
    """
    layout = layout_from_config(cfg)
    if single:
        todo = [(components(cfg)[-1].where, single_component(cfg), layout.world_size)]
    else:
        todo = [(c.where, c.slurm, c.ntasks) for c in components(cfg)]
    for where, comp, ntasks in todo:
        pname = comp.partition or cfg.slurm.partition or default
        pfield = f"{where}.partition" if comp.partition else "slurm.partition"
        if pname not in partitions:
            raise ConfigError(f"{pfield}: no partition {pname!r} on this cluster "
                              f"(sinfo lists {sorted(partitions)})")
        p = partitions[pname]
        if comp.nodes > p.nodes:
            raise ConfigError(f"{where}.nodes: {comp.nodes} nodes, partition {pname} has {p.nodes}")
        per_node = math.ceil(ntasks / comp.nodes)
        if per_node * comp.cpus_per_task > p.cpus:
            raise ConfigError(f"{where}.cpus_per_task: {ntasks} tasks on {comp.nodes} node(s) put "
                              f"{per_node} x {comp.cpus_per_task} CPUs on a node; partition {pname} "
                              f"nodes have {p.cpus} (raise {where}.nodes or lower cpus_per_task)")
        if comp.gpus_per_node > p.gpus:
            raise ConfigError(f"{where}.gpus_per_node: {comp.gpus_per_node} GPUs per node, partition "
                              f"{pname} nodes have {p.gpus}")
        if comp.mem and p.mem_mb and mem_mb(comp.mem) > p.mem_mb:
            raise ConfigError(f"{where}.mem: {comp.mem} per node, partition {pname} nodes have "
                              f"{p.mem_mb} MB")


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


def _component(comp: SlurmComponent, ntasks: int, default_partition: str, label: str,
               gpus_per_task: int = 0) -> list[str]:
    """One component's options. `gpus_per_task` > 0 (a het component of GPU ranks): Slurm
    gives each task its own GPUs (--gpus-per-task binds them to the task); 0: the node's
    GPUs (--gpus-per-node) are shared out by flexmarl_hpc.runtime.devices by role."""
    lines = [f"#SBATCH --nodes={comp.nodes}".ljust(36) + f"# {label}",
             f"#SBATCH --ntasks={ntasks}", f"#SBATCH --ntasks-per-node={math.ceil(ntasks / comp.nodes)}",
             f"#SBATCH --cpus-per-task={comp.cpus_per_task}"]
    if comp.gpus_per_node and gpus_per_task:
        lines.append(f"#SBATCH --gpus-per-task={gpus_per_task}")
    elif comp.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={comp.gpus_per_node}")
    if comp.mem:
        lines.append(f"#SBATCH --mem={comp.mem}")
    if comp.partition or default_partition:
        lines.append(f"#SBATCH --partition={comp.partition or default_partition}")
    return lines + [f"#SBATCH {opt}" for opt in comp.sbatch_options]


def _body(cfg: Config, srun: str, python: str, config_path: str, overrides: list[str]) -> list[str]:
    """`srun` contains {cmd} where the rank command goes ("${CMD[@]}")."""
    cmd = " ".join(shlex.quote(a) for a in [python, "-m", "flexmarl_hpc.run", config_path, *overrides])
    lines = ["", "# site set-up (slurm.setup)", *(cfg.slurm.setup or [":"]), "",
             "export PYTHONUNBUFFERED=1",
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
             srun.format(cmd='"${CMD[@]}"'),
             "rc=$?",
             'echo "flexmarl_hpc: ranks exited $rc at $(date -Is)"',
             f"if [ $rc -eq {EXIT_REQUEUE} ]; then"]
    if cfg.slurm.requeue:
        lines += [
            "  # The requeue ends this script. Slurm then holds the job for the credential lifetime",
            "  # (cred_expire, 120 s by default) from the moment it has ended, so only a client can",
            "  # release it early: `submit --wait` does, or scontrol update jobid=J StartTime=now.",
            '  echo "flexmarl_hpc: checkpointed after a preemption signal; requeueing"',
            '  scontrol requeue "$SLURM_JOB_ID" || echo "flexmarl_hpc: requeue refused '
            '(a preempted job is requeued by Slurm itself)"']
    else:
        lines.append('  echo "flexmarl_hpc: checkpointed; slurm.requeue is off: submit again to resume"')
    return lines + ["fi", "exit $rc", ""]


def hetjob_script(cfg: Config, config_path: str, overrides: list[str] = (), python: str = "python") -> str:
    """The sbatch text of one heterogeneous job (orchestrator, rollout pool, trainers).

    `config_path` and `overrides` are passed to `python -m flexmarl_hpc.run` unchanged
    (submit makes them absolute); `python` is the interpreter on the compute nodes.
    """
    validate_slurm(cfg)
    check_gpus(cfg)
    comps = components(cfg)
    lines = ["#!/bin/bash",
             f"# flexmarl_hpc run {cfg.run.name}: one heterogeneous job, rank order = component order",
             "#   tasks: " + ", ".join(f"{i} {c.name} {c.ntasks}" for i, c in enumerate(comps)),
             *_job_wide(cfg)]
    for i, c in enumerate(comps):
        if i:
            lines.append("#SBATCH hetjob")
        lines += _component(c.slurm, c.ntasks, cfg.slurm.partition, f"component {i}: {c.name}",
                            c.gpus_per_task)
    # one step over every component (one MPI_COMM_WORLD, ranks in component order), each with
    # its own --cpus-per-task: since Slurm 22.05 srun does not take it from the allocation
    srun = f"srun --mpi={cfg.slurm.mpi} " + " : ".join(
        f"--het-group={i} --cpus-per-task={c.slurm.cpus_per_task} {{cmd}}" for i, c in enumerate(comps))
    return "\n".join(lines + _body(cfg, srun, python, config_path, list(overrides)))


def gpu_widths(cfg: Config) -> dict[str, int]:
    """GPUs per task of each het component (flexmarl_hpc.runtime.devices.role_widths)."""
    return {"orchestrator": 0, "rollout": cfg.rollout.gpus_per_replica, "trainer": 1}


def check_gpus(cfg: Config, single: bool = False) -> None:
    """Refuse a job whose GPU ranks would share GPUs, naming the field: a node's tasks
    (ceil(tasks / nodes), placed in blocks of consecutive ranks) x their GPUs each must fit
    its gpus_per_node. `single`: every role on the same nodes (rank order of the layout).
    flexmarl_hpc.runtime.devices checks the same again on each node at start."""
    layout = layout_from_config(cfg)
    widths = gpu_widths(cfg)
    comps = components(cfg)
    if single:
        comp = single_component(cfg)
        if not comp.gpus_per_node:
            return
        per_node = math.ceil(layout.world_size / comp.nodes)
        # any run of per_node consecutive ranks may share a node (Slurm's block distribution
        # may put fewer on some nodes), so every window must fit
        w = [c.gpus_per_task for c in comps for _ in range(c.ntasks)]
        need = [sum(w[j:j + per_node]) for j in range(max(1, layout.world_size - per_node + 1))]
        if max(need) > comp.gpus_per_node:
            raise ConfigError(
                f"{comps[-1].where}.gpus_per_node: --single puts {per_node} ranks on a node (rank order: "
                f"orchestrator, replicas x {widths['rollout']} GPU, trainer ranks x 1 GPU), one node needs "
                f"{max(need)} GPUs but the allocation has {comp.gpus_per_node} per node (the largest "
                "gpus_per_node of the components); add nodes or GPUs, or use the het job")
        return
    for c in comps:
        comp, n, width = c.slurm, c.ntasks, c.gpus_per_task
        if not (comp.gpus_per_node and width):
            continue
        per_node = math.ceil(n / comp.nodes)
        if per_node * width > comp.gpus_per_node:
            raise ConfigError(
                f"{c.where}.gpus_per_node: {n} tasks on {comp.nodes} node(s) put {per_node} on a node, "
                f"x {width} GPU(s) each = {per_node * width} GPUs, but a node has "
                f"{comp.gpus_per_node}; raise {c.where}.nodes or gpus_per_node (GPUs are not shared)")


def single_component(cfg: Config) -> SlurmComponent:
    """All ranks in one allocation: the nodes of the rollout and trainer components (the
    orchestrator is one CPU rank that fits beside them), the largest per-task CPUs,
    per-node GPUs and memory of them all, the (last) trainer component's partition and
    sbatch_options."""
    comps = [c.slurm for c in components(cfg)]
    mems = [c.mem for c in comps if c.mem]
    return SlurmComponent(
        nodes=sum(c.nodes for c in comps[1:]),
        gpus_per_node=max(c.gpus_per_node for c in comps),
        cpus_per_task=max(c.cpus_per_task for c in comps),
        mem=max(mems, key=mem_mb) if mems else "",
        partition=comps[-1].partition,
        sbatch_options=list(comps[-1].sbatch_options))


def single_script(cfg: Config, config_path: str, overrides: list[str] = (), python: str = "python") -> str:
    """One allocation of all ranks (sites without het jobs); rank order is the layout's."""
    validate_slurm(cfg)
    check_gpus(cfg, single=True)
    world = layout_from_config(cfg).world_size
    lines = ["#!/bin/bash",
             f"# flexmarl_hpc run {cfg.run.name}: one allocation of {world} tasks "
             "(rank 0 orchestrator, then rollout replicas, then trainer ranks)",
             *_job_wide(cfg),
             *_component(single_component(cfg), world, cfg.slurm.partition, "all ranks")]
    comp = single_component(cfg)
    # every role shares the nodes: Slurm cannot tell a replica from the orchestrator, so the
    # tasks see their node's GPUs and flexmarl_hpc.runtime.devices gives each GPU rank its own
    bind = " --gpu-bind=none" if comp.gpus_per_node else ""
    srun = f"srun --mpi={cfg.slurm.mpi} --ntasks={world} --cpus-per-task={comp.cpus_per_task}{bind} {{cmd}}"
    return "\n".join(lines + _body(cfg, srun, python, config_path, list(overrides)))
