"""Pure checks of the `slurm:` section, run before a job script is written.

    from flexmarl_hpc.config.validate_slurm import check_gpus, validate_slurm
    validate_slurm(plan); check_gpus(plan, single=False)     # plan: config/plan.py      # ConfigError naming the field

What needs the cluster's partitions (`sinfo`) is launch/preflight.py: check_capacity.
"""
from __future__ import annotations

import math
import re

from flexmarl_hpc.config.plan import Plan
from flexmarl_hpc.config.resources import last_trainer
from flexmarl_hpc.config.schema import Config, ConfigError, SlurmComponent

MPI_PLUGINS = ("pmi2", "pmix", "pmix_v3", "pmix_v4", "pmix_v5", "cray_shasta")
"""`srun --mpi=` values a flexmarl_hpc world can start with (`srun --mpi=list` shows the site's)."""
MEM_RE = re.compile(r"^[1-9]\d*[KMGT]?$")
NAME_RE = re.compile(r"^[A-Za-z0-9_.+-]+$")
SLURM_NAME_RE = re.compile(r"^[A-Za-z0-9_.,+@:-]*$")   # partition lists, accounts, QOS names
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
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
    "(trainer ranks see their node's GPUs)", "gpu-bind": "nothing (flexmarl_hpc.runtime.devices binds by role)"}


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


def validate_slurm(plan: Plan) -> None:
    """Refuse a bad `slurm:` section before anything is submitted; the error names the field.

    Checks what can be told from the config alone; `check_capacity` adds what needs the
    cluster's partitions.
    """
    cfg = plan.cfg
    s = cfg.slurm
    try:
        limit = parse_time(s.time)
    except ValueError:
        raise ConfigError(f"slurm.time: expected minutes, MM:SS, HH:MM:SS or D-HH[:MM[:SS]], "
                          f"got {s.time!r}") from None
    if s.mpi not in MPI_PLUGINS:
        raise ConfigError(f"slurm.mpi: expected one of {list(MPI_PLUGINS)}, got {s.mpi!r} "
                          "(`srun --mpi=list` shows the site's plugins)")
    # signal_seconds' range (0..65535, sbatch's) is its bound; here only against the time limit
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
    for c in plan.components:
        comp: SlurmComponent = c.slurm
        where = c.where
        if comp.nodes > c.ntasks:
            raise ConfigError(f"{where}.nodes: {comp.nodes} nodes for {c.ntasks} tasks leaves a node idle")
        # nodes >= 1, gpus_per_node >= 0, cpus_per_task >= 1: the fields' bounds (load_config)
        if comp.mem not in ("auto", "0") and not MEM_RE.match(comp.mem):
            raise ConfigError(f"{where}.mem: expected a size per node like 400G or 64000M, 0 (all of "
                              f"each node's memory) or auto, got {comp.mem!r}")
        if not SLURM_NAME_RE.match(comp.partition):
            raise ConfigError(f"{where}.partition: {comp.partition!r} is not a Slurm name")
        check_sbatch_options(comp.sbatch_options, f"{where}.sbatch_options", where)
    check_sbatch_options(s.sbatch_options, "slurm.sbatch_options", "slurm.<component>")
    if not MEM_RE.match(s.mem_per_cpu):
        raise ConfigError(f"slurm.mem_per_cpu: expected a size like 4G or 1000M, got {s.mem_per_cpu!r}")
    if not MEM_RE.match(s.mem_per_gpu):
        raise ConfigError(f"slurm.mem_per_gpu: expected a size like 120G or 64000M, got {s.mem_per_gpu!r}")
    check_env(s.env)


def check_env(env: dict[str, str]) -> None:
    """slurm.env: shell variable names; values are quoted when written, any text but a newline."""
    for name, value in env.items():
        if not ENV_NAME_RE.match(name):
            raise ConfigError(f"slurm.env.{name}: not a shell variable name (letters, digits, _; "
                              "not starting with a digit)")
        if not isinstance(value, str) or "\n" in value:
            raise ConfigError(f"slurm.env.{name}: expected one line of text, got {value!r}")


def check_sbatch_options(options: list[str], field: str, where: str) -> None:
    """Each extra option is one long sbatch option without blanks, not one the config owns."""
    for opt in options:
        m = OPTION_RE.match(opt) if isinstance(opt, str) else None
        if not m:
            raise ConfigError(f"{field}: expected long sbatch options like '--constraint=a100' or "
                              f"'--exclusive' (no blanks), got {opt!r}")
        if m.group(1) in OWNED_OPTIONS:
            raise ConfigError(f"{field}: {opt!r} is set by " + OWNED_OPTIONS[m.group(1)].format(where=where))


def gpu_widths(cfg: Config) -> dict[str, int]:
    """GPUs per task of each het component (flexmarl_hpc.runtime.devices.role_widths)."""
    return {"orchestrator": 0, "rollout": cfg.rollout.gpus_per_replica, "trainer": 1}


def check_gpus(plan: Plan, single: bool = False) -> None:
    """Refuse a job whose GPU ranks would share GPUs, naming the field: a node's tasks
    (ceil(tasks / nodes), placed in blocks of consecutive ranks) x their GPUs each must fit
    its gpus_per_node. `single`: every role on the same nodes (rank order of the layout).
    flexmarl_hpc.runtime.devices checks the same again on each node at start."""
    layout, comps = plan.layout, plan.components
    widths = gpu_widths(plan.cfg)
    if single:
        comp = plan.single
        if not comp.gpus_per_node:
            return
        per_node = math.ceil(layout.world_size / comp.nodes)
        # any run of per_node consecutive ranks may share a node (Slurm's block distribution
        # may put fewer on some nodes), so every window must fit
        w = [c.gpus_per_task for c in comps for _ in range(c.ntasks)]
        need = [sum(w[j:j + per_node]) for j in range(max(1, layout.world_size - per_node + 1))]
        if max(need) > comp.gpus_per_node:
            raise ConfigError(
                f"{last_trainer(comps).where}.gpus_per_node: --single puts {per_node} ranks on a node (rank order: "
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
