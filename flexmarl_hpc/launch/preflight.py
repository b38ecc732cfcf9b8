"""Checks before a launch that need more than the config: the built task, this machine,
the run folder, or the cluster's partitions.

    task = preflight(plan, local=True)            # run.py, before mpiexec: ConfigError or the task
    check_capacity(plan, *cluster_partitions())   # submit.py, against what `sinfo` reports

The pure checks of the config (field ranges, pools and groups, the `slurm:` section) are
flexmarl_hpc.config.validate and .validate_slurm. Importing this module is cheap: the task,
numpy and h5py are imported inside the checks that need them.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
from dataclasses import dataclass

from flexmarl_hpc.config.layout import RankLayout
from flexmarl_hpc.config.load import to_dict
from flexmarl_hpc.config.plan import Plan
from flexmarl_hpc.config.resources import component_mem, last_trainer, mem_mb, param_count
from flexmarl_hpc.config.schema import Config, ConfigError


def preflight(plan: Plan, local: bool):
    """Every check a run makes before its ranks start; returns the built task. `local`: the
    ranks would start on this machine (mpiexec), so their number must fit it. The caller has
    checked the output folder (`check_output_dir`) and its lock (`store.lock`) first."""
    cfg = plan.cfg
    if local:
        check_local_ranks(cfg, plan.layout)
    check_resumable(cfg, chunks=local)
    if cfg.workflow.episode:             # user code imported in a child before this process does
        from flexmarl_hpc.workflows.episode_check import check_episode
        check_episode(cfg.workflow.episode, cfg.workflow.episode_args)
        for field in ("agent", "reward"):        # an `openai` program and its reward function
            if getattr(cfg.workflow, field):
                check_episode(getattr(cfg.workflow, field), {}, field=f"workflow.{field}")
    from flexmarl_hpc.workflows.build import build_task, check_models
    task = build_task(cfg)
    if cfg.workflow.episode:             # its dataset read (and refused) before the model checks
        len(task.stream)
    check_models(cfg, task)
    if local:
        check_local_memory(plan, task)
    check_eval(cfg, task)
    check_lengths(cfg, task)
    check_backend_math(plan, task)
    return task


# A local run starts every rank as a Python process with torch on this machine. Ranks mostly
# wait (no busy polling), so several share a core, but each needs ~RANK_MEMORY of memory and
# beyond LOCAL_RANKS_PER_CPU per core the job spends its time switching; a bigger layout is
# for Slurm (srun starts the ranks there and this check does not apply).
LOCAL_RANKS_PER_CPU = 16
RANK_MEMORY = 256 * 2**20


def local_rank_limit() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(4, min(LOCAL_RANKS_PER_CPU * cpus, mem // RANK_MEMORY))


def check_local_ranks(cfg: Config, layout: RankLayout) -> None:
    limit = local_rank_limit()
    if layout.world_size <= limit:
        return
    trainer_ranks = sum(layout.group_sizes)
    field = "rollout.replicas" if layout.replicas >= trainer_ranks else "trainer.ranks_per_group"
    raise ConfigError(f"{field}: the layout needs {layout.world_size} ranks (1 + {layout.replicas} replicas "
                      f"+ {trainer_ranks} trainer ranks); a local run starts at most {limit} on this "
                      f"machine ({LOCAL_RANKS_PER_CPU} per CPU core, {RANK_MEMORY >> 20} MiB each); "
                      "submit it to Slurm (python -m flexmarl_hpc.submit)")


# ---------------------------------------------------------------------------------------
# memory of a local run (issue 28 extends it to the GPU shapes)
# ---------------------------------------------------------------------------------------
SAMPLE_BYTES = 4096
"""Orchestrator bytes per tree node (a Python dataclass, its group/children lists, the
journal row and the request/result messages), besides its tokens."""
TOKEN_BYTES = 64
"""Bytes per token held for a sample (prompt, response and logprob as Python ints/floats in
lists, and the trainer's tensors of its batch)."""
TRAIN_BYTES_PER_PARAM = 16
"""fp32 weights, gradients and Adam's two moments (the torch trainer)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a run needs, by part (their sum is `total`)."""
    ranks: int                   # world_size x RANK_MEMORY: each rank's Python + torch
    trainer: int                 # weights, grads, Adam of each trainer rank's agents
    replicas: int                # each replica's weights, KV cache and logits of a rollout batch
    samples: int                 # the orchestrator's tree nodes of the steps in flight

    @property
    def total(self) -> int:
        return self.ranks + self.trainer + self.replicas + self.samples


def estimate_memory(plan: Plan, models: dict, cuda: bool = True) -> MemoryEstimate:
    """Memory (bytes) a run of `plan` needs, over all its ranks: a pure function of the config
    and each agent's model shape (`models`: agent -> ModelArgs, as config.hf_config.model_args
    gives, vocabulary included). A sequence is at most min(max_seq_len, rollout.max_model_len).
    Per trainer rank: its agents' params x 16 bytes / (TP x PP), plus a micro-batch's logits
    and their gradient; per replica: its pool's agents' weights (replica_bytes_per_weight:
    4 bytes on the torch engine, else rollout.dtype's; `cuda`: the replicas run on GPUs)
    plus a full rollout batch's KV cache and logits; the orchestrator: SAMPLE_BYTES +
    TOKEN_BYTES x sequence per tree node of the steps in flight (steps_in_flight steps of
    inputs_per_step + overprovision inputs, each a tree of samples); each rank
    RANK_MEMORY besides. Meant as an upper estimate, for refusing what cannot fit (measured on
    configs/local.yaml: docs/LOG.md)."""
    cfg, width = plan.cfg, plan.bytes_per_weight(cuda)
    params = {a: param_count(m, m.vocab_size) for a, m in models.items()}
    seq = {a: min(m.max_seq_len, cfg.rollout.max_model_len or m.max_seq_len) for a, m in models.items()}
    logits = {a: cfg.trainer.micro_batch_size * seq[a] * m.vocab_size * 4 * 2 for a, m in models.items()}
    trainer = sum(g.ranks * sum(params[a] * TRAIN_BYTES_PER_PARAM // (g.tensor_parallel * g.pipeline_parallel)
                                + logits[a] for a in g.agents) for g in plan.groups)
    replicas = 0
    for pool in plan.pools:
        per = 0
        for a in pool.agents:
            m = models[a]
            kv = 2 * m.num_layers * m.num_kv_heads * (m.hidden_size // m.num_heads) * seq[a]
            per += params[a] * width + cfg.rollout.max_batch * (kv * width + m.vocab_size * 4)
        replicas += pool.replicas * per
    w = cfg.workflow
    nodes_per_input = sum(math.prod(t.samples for t in w.turns[:i + 1]) for i in range(len(w.turns)))
    steps = plan.steps_in_flight
    samples = steps * (w.inputs_per_step + cfg.pipeline.overprovision) * nodes_per_input * (
        SAMPLE_BYTES + TOKEN_BYTES * max(seq.values()))
    world = 1 + sum(p.replicas for p in plan.pools) + sum(g.ranks for g in plan.groups)
    return MemoryEstimate(world * RANK_MEMORY, trainer, replicas, samples)


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none: not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_local_memory(plan: Plan, task) -> None:
    """A local run's estimate (estimate_memory) fits this machine's available memory."""
    import torch                                 # runtime.build imports it anyway
    from flexmarl_hpc.config.hf_config import model_args
    avail = mem_available()
    if avail is None:
        return
    cfg = plan.cfg
    est = estimate_memory(plan, {a: model_args(cfg, task, a) for a in cfg.agent_names}, torch.cuda.is_available())
    if est.total <= avail:
        return
    parts = {"workflow.inputs_per_step": est.samples, "rollout.max_batch": est.replicas,
             "trainer.ranks_per_group": est.trainer, "rollout.replicas": est.ranks}
    field = max(parts, key=parts.get)
    gib = lambda b: f"{b / 2**30:.1f} GiB"         # noqa: E731
    raise ConfigError(f"{field}: the run needs about {gib(est.total)} of memory (samples in flight "
                      f"{gib(est.samples)}, replicas {gib(est.replicas)}, trainers {gib(est.trainer)}, "
                      f"{est.ranks // RANK_MEMORY} ranks {gib(est.ranks)}), this machine has "
                      f"{gib(avail)} available; make it smaller or submit it to Slurm")


def check_eval(cfg: Config, task) -> None:
    """run.eval_every > 0 needs the task's held-out inputs (an episode workflow: held-out
    examples), as many as run.eval_inputs."""
    if not cfg.run.eval_every:
        return
    if cfg.workflow.episode:                     # the eval file's first run.eval_inputs examples
        task.stream.heldout(cfg.run.eval_inputs)  # (DatasetError names workflow.dataset.eval)
        return
    name = cfg.workflow.task
    try:
        inputs = task.heldout_inputs(cfg.run.eval_inputs)
    except NotImplementedError:
        raise ConfigError(f"run.eval_every: {cfg.run.eval_every} asks for evaluation, but the task "
                          f"{name} defines no heldout_inputs(n) (see flexmarl_hpc/workflows/base.py); "
                          "add it or set run.eval_every=0") from None
    if len(inputs) != cfg.run.eval_inputs:
        raise ConfigError(f"run.eval_inputs: {name}.heldout_inputs({cfg.run.eval_inputs}) returned "
                          f"{len(inputs)} inputs")


def check_episode_lengths(cfg: Config, task) -> None:
    """Episode workflows: the dataset loads, and a reply of max_new_tokens fits every agent's
    context with room for a prompt (a longer conversation fails its episode at run time)."""
    len(task.stream)                              # loads the files: a bad one is named now
    for agent, limit in task.context_limits(cfg).items():
        if cfg.workflow.max_new_tokens >= limit:
            raise ConfigError(f"workflow.max_new_tokens: expected < {limit} (the context of agent "
                              f"{agent!r}: its max_seq_len / rollout.max_model_len), got "
                              f"{cfg.workflow.max_new_tokens}")


def turn_prompts(cfg: Config, task):
    """(turn index, turn, prompt tokens) of each turn down one branch of a few inputs (the
    run's first training inputs, and held-out ones where it evaluates), every response
    full-length (its max_new_tokens of filler): the longest prompts a tree workflow makes.
    Stops a branch where the task rejects the filler."""
    import numpy as np
    from flexmarl_hpc.workflows.base import Path as TaskPath
    inputs = task.sample_inputs(np.random.default_rng(cfg.run.seed), 4)
    if cfg.run.eval_every:
        inputs += list(task.heldout_inputs(cfg.run.eval_inputs)[:4])
    for inp in inputs:
        path = TaskPath(inp)
        for t, turn in enumerate(cfg.workflow.turns):
            try:
                prompt = task.prompt(t, path)
            except Exception:           # a task may reject the filler responses: check what we can
                break
            yield t, turn, len(prompt)
            filler = tuple(prompt[-1:] or [0]) * turn.max_new_tokens
            path = TaskPath(path.input, path.responses + (filler,))


def check_lengths(cfg: Config, task) -> None:
    """Each turn's prompt plus its max_new_tokens fits the acting agent's max_seq_len (and
    rollout.max_model_len): walk a few inputs down one branch, with full-length responses."""
    from flexmarl_hpc.config.hf_config import model_args
    if cfg.workflow.episode:
        return check_episode_lengths(cfg, task)
    for t, turn, lp in turn_prompts(cfg, task):
        need = lp + turn.max_new_tokens
        where = f"agents.{turn.agent}" if turn.agent in cfg.agents else "model"
        limit = model_args(cfg, task, turn.agent).max_seq_len
        if need > limit:
            raise ConfigError(f"{where}.max_seq_len: expected >= {need} (turn {t} of agent "
                              f"{turn.agent!r}: a prompt of {lp} tokens + max_new_tokens "
                              f"{turn.max_new_tokens}), got {limit}")
        if cfg.rollout.max_model_len and need > cfg.rollout.max_model_len:
            raise ConfigError(f"rollout.max_model_len: expected >= {need} (turn {t} of agent "
                              f"{turn.agent!r}), got {cfg.rollout.max_model_len}")


def check_backend_math(plan: Plan, task) -> None:
    """The megatron trainer builds its GPTModel with rotary_base only: a checkpoint with
    Llama-3 RoPE scaling would train with other math than the replicas sample with.
    (megatron-core's GPTModel has rope_scaling/rope_scaling_factor with low/high frequency
    factors 1/4 and original context 8192 fixed; once the trainer passes them, only other
    values need refusing.)"""
    if all(g.backend != "megatron" for g in plan.groups):
        return
    cfg = plan.cfg
    from flexmarl_hpc.config.hf_config import model_args
    for agent in cfg.agent_names:
        if model_args(cfg, task, agent).rope_llama3 is not None:
            where = f"agents.{agent}.checkpoint" if agent in cfg.agents else "model.checkpoint"
            raise ConfigError(f"{where}: Llama-3 RoPE scaling (rope_type llama3) is not supported by "
                              "trainer.backend=megatron yet; use trainer.backend=torch")


def _files_written(cfg: Config) -> list[str]:
    """Paths (relative to run.output_dir) of the longest names a run writes there."""
    ckpt = [f"checkpoints/{a}/v000000.pt.tmp" for a in cfg.agent_names]
    return [f"{cfg.run.name}.h5", "config.yaml", "train.log", *ckpt]


def _exists(path) -> bool:
    """lstat succeeds; a name too long, or a file where a folder should be, is 'not there'
    (Path.exists raises on ENAMETOOLONG; the walk up then finds what is wrong)."""
    try:
        os.lstat(path)
        return True
    except OSError:
        return False


def check_output_dir(cfg: Config) -> None:
    """run.output_dir is a writable folder, or can be created as one, and the files a run
    writes there have names within NAME_MAX and PATH_MAX. Nothing is written: the nearest
    existing folder is judged by stat, statvfs (a read-only mount) and access (permissions)."""
    out = cfg.output_dir.absolute()
    base = out
    while not _exists(base) and base != base.parent:
        base = base.parent
    where = "run.output_dir"
    if not base.is_dir():
        raise ConfigError(f"{where}: {base} exists and is not a folder (expected a folder for the run, "
                          f"{out})")
    name_max = os.pathconf(base, "PC_NAME_MAX")
    path_max = os.pathconf(base, "PC_PATH_MAX")
    for rel in [*out.relative_to(base).parts, *_files_written(cfg)]:
        for part in rel.split("/"):
            if len(os.fsencode(part)) > name_max:
                field = "run.name" if cfg.run.name in part else where
                raise ConfigError(f"{field}: the name {part[:40]!r}... is {len(os.fsencode(part))} bytes, "
                                  f"the file system allows {name_max} (NAME_MAX)")
        if len(os.fsencode(str(out / rel))) >= path_max:
            raise ConfigError(f"{where}: the path {str(out / rel)[:40]!r}... is longer than the file "
                              f"system's PATH_MAX ({path_max})")
    if os.statvfs(base).f_flag & os.ST_RDONLY:
        raise ConfigError(f"{where}: {base} is on a read-only file system (the run writes {out})")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: {base} is not writable by this user (the run writes {out})")


# what a resumed run must share with the run that wrote the store and the checkpoints
RESUME_KEYS = ("workflow", "model", "agents", "run.seed", "rollout.temperature")


def check_resumable(cfg: Config, chunks: bool = True) -> None:
    """Refuse to resume into an output_dir whose store is truncated, damaged, foreign or of
    another schema version, or was written by a run with another workflow, model or seed
    (the store and checkpoints would silently mix), naming what is wrong. The store is only
    read: its size against its superblock, every committed chunk against its checksum and
    every other check of the writer's re-open (store.recovery.check_reopen: a sample
    without its parent's row too); nothing in it changes, and no rank has started. `chunks=False` (every
    rank of an MPI job runs this: N reads of a big store) leaves the chunks to rank 0's
    StoreFile, which verifies them before it changes the file."""
    import yaml
    from flexmarl_hpc.store.checksum import open_read, verify_path
    from flexmarl_hpc.store.recovery import check_reopen
    from flexmarl_hpc.store.schema import check_file, table_names
    path = cfg.output_dir / f"{cfg.run.name}.h5"
    if not (cfg.run.resume and path.exists()):
        return
    try:
        with open_read(path) as f:
            check_file(f, path)
            old = yaml.safe_load(f.attrs.get("config_yaml", "")) or {}
        changed = [k for k in RESUME_KEYS if _get(old, k) != _get(to_dict(cfg), k)]
        if chunks and changed:          # damage first, then the other run's keys
            verify_path(path)
        elif chunks:                    # every check of the re-open (no writer holds it: the lock)
            check_reopen(path, cfg.agent_names, table_names(cfg.agent_names))
    except (OSError, ValueError, RuntimeError, yaml.YAMLError) as e:    # RuntimeError: h5py, a garbled superblock
        raise ConfigError(f"run.output_dir: cannot resume: {' '.join(str(e).split())}; move the file "
                          "away (or salvage it) or set run.resume=false and another run.output_dir") from None
    if changed:
        raise ConfigError(f"run.output_dir: {cfg.output_dir} holds a run with different {', '.join(changed)}; "
                          "resuming would mix two runs. Use another run.output_dir (or the old config)")


def _get(d: dict, dotted: str):
    for k in dotted.split("."):
        d = d.get(k) if isinstance(d, dict) else None
    return d


# ---------------------------------------------------------------------------------------
# what the cluster offers (sinfo) and whether the job fits it
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Partition:
    """What one partition offers, per node (the largest node when nodes differ)."""
    nodes: int
    cpus: int
    gpus: int = 0
    mem_mb: int = 0                           # 0: unknown


def parse_sinfo(text: str) -> tuple[dict[str, Partition], str]:
    """`sinfo -h -o '%P|%D|%c|%m|%G'` -> ({partition: Partition}, default partition).

    sinfo prints one line per partition and node shape; a partition's capacity is its
    largest node (never refuse what some node could run) and its total node count.
    """
    parts: dict[str, Partition] = {}
    default = ""
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5:
            continue
        name, nodes, cpus, mem, gres = fields
        if name.endswith("*"):
            name = default = name[:-1]
        gpus = sum(int(n) for n in re.findall(r"gpu(?::[^:,(]+)?:(\d+)", gres))
        p = Partition(int(nodes), int(re.sub(r"\D.*", "", cpus) or 0), gpus,
                      int(re.sub(r"\D.*", "", mem) or 0))
        q = parts.get(name)
        parts[name] = p if q is None else Partition(q.nodes + p.nodes, max(q.cpus, p.cpus),
                                                    max(q.gpus, p.gpus), max(q.mem_mb, p.mem_mb))
    return parts, default


def cluster_partitions() -> tuple[dict[str, Partition], str] | None:
    """The partitions of the cluster this host submits to; None where `sinfo` cannot tell."""
    try:
        # bounded: a wedged slurmctld must not hang the submit
        p = subprocess.run(["sinfo", "-h", "-o", "%P|%D|%c|%m|%G"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts, default = parse_sinfo(p.stdout)
    return (parts, default) if p.returncode == 0 and parts else None


def check_capacity(plan: Plan, partitions: dict[str, Partition], default: str, single: bool = False) -> None:
    """Refuse components that no node of their partition can hold, naming the field.

    `partitions` maps partition name -> Partition (from `sinfo`), `default` is the
    cluster's default partition. Tasks are spread evenly over a component's nodes, so a
    node needs ceil(tasks / nodes) x cpus_per_task CPUs. `single`: the one allocation of
    `single_script` (its errors name the trainer fields, whose partition it uses).
    """
    cfg = plan.cfg
    if single:
        comp = plan.single
        todo = [(last_trainer(plan.components).where, comp, plan.layout.world_size, comp.mem)]
    else:
        todo = [(c.where, c.slurm, c.ntasks, component_mem(cfg, c)) for c in plan.components]
    for where, comp, ntasks, mem in todo:
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
        if p.mem_mb and mem_mb(mem) > p.mem_mb:        # --mem=0 (all of a node) always fits
            field = f"{where}.mem" if comp.mem != "auto" else (
                "slurm.mem_per_cpu" if not comp.gpus_per_node else "slurm.mem_per_gpu")
            raise ConfigError(f"{field}: {mem} per node ({where}.mem is {comp.mem!r}), partition "
                              f"{pname} nodes have {p.mem_mb} MB")
