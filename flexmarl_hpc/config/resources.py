"""Heterogeneous resources: rollout pools and trainer groups, resolved from the config.

A config either lists them (`rollout.pools`, `trainer.named_groups`: each its own het-job
component) or describes the uniform case (`rollout.replicas` in one
pool, `trainer.groups` x `trainer.ranks_per_group` in one component); both resolve to the
same `Pool` / `Group` lists here, so the layout, the job script, the scheduler and the
trainers read one description. Everything is pure (no MPI, no Slurm).

    pools, groups = rollout_pools(cfg), trainer_groups(cfg)
    for c in components(cfg, pools, groups): print(c.name, c.ntasks, c.agents)   # het-job order

Only config/plan.py calls the resolving functions here (rollout_pools, trainer_groups,
group_trainer_config, layout_from_config, components), once per run: everything else reads
the resolved `Plan` (tests/unit/test_plan.py holds it).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from flexmarl_hpc.config.layout import ORCHESTRATOR, ROLLOUT, TOOLS, TRAINER, RankLayout
from flexmarl_hpc.config.schema import Config, ModelConfig, RolloutConfig, SlurmComponent, TrainerConfig


FIT_FRACTION = 0.9
"""Share of a replica's GPU memory its weights may take (the rest: KV cache, activations)."""


@dataclass(frozen=True)
class Pool:
    name: str
    replicas: int
    gpus_per_replica: int
    agents: tuple[str, ...]
    """Agents the pool may serve (explicit, or every agent whose model fits)."""
    slurm: SlurmComponent
    where: str
    """Config path of the pool, for error messages (`rollout.pools[1]`, or `rollout`)."""
    gpu_memory_gb: float = 0.0
    """One GPU's memory (0: not given); vLLM's memory fraction is taken from it."""


@dataclass(frozen=True)
class Group:
    name: str
    agents: tuple[str, ...]
    """Agents whose state starts on this group (the first resident)."""
    ranks: int
    tensor_parallel: int
    pipeline_parallel: int
    backend: str
    swap: str
    """Swap domain label: agents move only between groups with the same label."""
    slurm: SlurmComponent
    where: str

    @property
    def shape(self) -> tuple[int, int, int, str]:
        return self.ranks, self.tensor_parallel, self.pipeline_parallel, self.backend

    def describe(self) -> str:
        return (f"{self.ranks} ranks, TP {self.tensor_parallel}, PP {self.pipeline_parallel}, "
                f"{self.backend}")


def steps_in_flight(max_staleness: int) -> int:
    """How many consecutive steps may hold samples at once (pipeline.max_staleness): the
    slowest agent's step and max_staleness + 1 beyond it (scheduler.Gate.may_admit: an agent
    samples up to max_staleness steps ahead of its version, and one step more while a slower
    agent still trains). As many versions of an agent's weights may still be asked for, by a
    request of the oldest of them. The scheduler's admission, preflight's memory estimate of
    the samples, and the simulator's kept weights (sim/inprocess.py) all read this window."""
    if max_staleness < 0:
        raise ValueError(f"pipeline.max_staleness: expected >= 0, got {max_staleness}")
    return max_staleness + 2


# ---------------------------------------------------------------------------------------
# model sizes
# ---------------------------------------------------------------------------------------
def param_count(m: ModelConfig, vocab: int = 0) -> int:
    """Parameters of a Llama/Qwen2 decoder; `vocab` 0 counts the layers only (the task's
    vocabulary is not known to the config: a lower bound, so only sure misfits are refused)."""
    head = m.hidden_size // m.num_heads
    kv = m.num_kv_heads * head
    attn = m.hidden_size * (m.hidden_size + 2 * kv) + m.hidden_size * m.hidden_size
    bias = (m.hidden_size + 2 * kv) if m.qkv_bias else 0
    mlp = 3 * m.hidden_size * m.intermediate_size
    layer = attn + bias + mlp + 2 * m.hidden_size
    emb = vocab * m.hidden_size * (1 if m.tie_embeddings else 2)
    return m.num_layers * layer + emb + m.hidden_size


def replica_bytes_per_weight(rollout: RolloutConfig, cuda: bool = True) -> int:
    """Bytes one weight takes on a rollout replica: the torch engine runs fp32 (validate
    refuses it another dtype); vLLM runs rollout.dtype, auto being bf16 on a GPU and fp32 on
    CPU (rollout/vllm_engine.engine_dtype). The pools' fit and preflight's memory read it."""
    if rollout.backend == "torch" or rollout.dtype == "fp32" or (rollout.dtype == "auto" and not cuda):
        return 4
    return 2


def weight_gb(cfg: Config, agent: str) -> float:
    """GB of an agent's weights on a replica of a GPU pool."""
    return param_count(cfg.model_for(agent)) * replica_bytes_per_weight(cfg.rollout) / 1e9


def fits(cfg: Config, agent: str, gpus_per_replica: int, gpu_memory_gb: float) -> bool:
    return gpu_memory_gb <= 0 or weight_gb(cfg, agent) <= FIT_FRACTION * gpus_per_replica * gpu_memory_gb


# ---------------------------------------------------------------------------------------
# resolution
# ---------------------------------------------------------------------------------------
def rollout_pools(cfg: Config) -> list[Pool]:
    ro = cfg.rollout
    if not ro.pools:
        return [Pool("rollout", ro.replicas, ro.gpus_per_replica, tuple(cfg.agent_names), cfg.slurm.rollout,
                     "rollout")]
    out = []
    for i, p in enumerate(ro.pools):
        agents = tuple(p.agents) or tuple(a for a in cfg.agent_names
                                          if fits(cfg, a, p.gpus_per_replica, p.gpu_memory_gb))
        out.append(Pool(p.name or f"pool{i}", p.replicas, p.gpus_per_replica, agents, p.slurm,
                        f"rollout.pools[{i}]", p.gpu_memory_gb))
    return out


def trainer_groups(cfg: Config) -> list[Group]:
    tr = cfg.trainer
    if not tr.named_groups:
        G = cfg.num_trainer_groups
        return [Group(f"group{g}", tuple(a for i, a in enumerate(cfg.agent_names) if i % G == g),
                      tr.ranks_per_group, tr.tensor_parallel, tr.pipeline_parallel, tr.backend,
                      "all", cfg.slurm.trainer, "trainer") for g in range(G)]
    return [Group(g.name or f"group{i}", tuple(g.agents), g.ranks, g.tensor_parallel,
                  g.pipeline_parallel, g.backend, g.swap, g.slurm, f"trainer.named_groups[{i}]")
            for i, g in enumerate(tr.named_groups)]


def group_trainer_config(cfg: Config, group: Group) -> TrainerConfig:
    """The trainer section as one group sees it: its own backend and TP/PP/ranks."""
    return dataclasses.replace(cfg.trainer, backend=group.backend, ranks_per_group=group.ranks,
                               tensor_parallel=group.tensor_parallel,
                               pipeline_parallel=group.pipeline_parallel, named_groups=[])


def swap_peers(groups: Sequence[Group], g: int) -> list[int]:
    """Groups that may take an agent from group `g` (itself first): same swap label."""
    if not groups[g].swap:
        return [g]
    return [g] + [h for h, other in enumerate(groups) if h != g and other.swap == groups[g].swap]


# ---------------------------------------------------------------------------------------
# het-job components
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Component:
    name: str
    """Label: orchestrator, rollout, trainer (uniform case), `pool NAME`, `group NAME`."""
    where: str
    """Config path of its slurm section, for error messages."""
    slurm: SlurmComponent
    ntasks: int
    gpus_per_task: int
    """GPUs of one task (0: the orchestrator)."""
    first_rank: int
    agents: tuple[str, ...]
    role: str = ORCHESTRATOR
    """orchestrator, rollout, trainer or tools: replicas get their GPU blocks from Slurm
    (`--gpus-per-task`), trainer ranks see their node's GPUs (`--gpus-per-node`); tool
    ranks (tools.ranks) run sandboxes and reward functions on CPUs."""

    @property
    def tasks_per_node(self) -> int:
        return -(-self.ntasks // self.slurm.nodes)


def components(cfg: Config, pools: Sequence[Pool], groups: Sequence[Group]) -> list[Component]:
    """Het-job components in rank order: orchestrator, pools..., trainer groups..., and the
    tool ranks last (tools.ranks > 0), so every other rank keeps its number."""
    s = cfg.slurm
    out = [Component("orchestrator", "slurm.orchestrator", s.orchestrator, 1, 0, 0, ())]
    rank = 1
    if cfg.rollout.pools:
        for p in pools:
            out.append(Component(f"pool {p.name}", f"{p.where}.slurm", p.slurm, p.replicas,
                                 p.gpus_per_replica, rank, p.agents, ROLLOUT))
            rank += p.replicas
    else:
        out.append(Component("rollout", "slurm.rollout", s.rollout, pools[0].replicas,
                             pools[0].gpus_per_replica, rank, pools[0].agents, ROLLOUT))
        rank += pools[0].replicas
    if cfg.trainer.named_groups:
        for g in groups:
            out.append(Component(f"group {g.name}", f"{g.where}.slurm", g.slurm, g.ranks, 1, rank, g.agents,
                                 TRAINER))
            rank += g.ranks
    else:
        out.append(Component("trainer", "slurm.trainer", s.trainer, sum(g.ranks for g in groups), 1,
                             rank, tuple(cfg.agent_names), TRAINER))
        rank += sum(g.ranks for g in groups)
    if cfg.tools.ranks:
        out.append(Component("tools", "slurm.tools", s.tools, cfg.tools.ranks, 0, rank, (), TOOLS))
    return out


def last_trainer(comps: Sequence[Component]) -> Component:
    """The last trainer component: `--single` takes its partition and options."""
    return [c for c in comps if c.role == TRAINER][-1]


def mem_mb(size: str) -> int:
    """'64G' -> 65536; a bare number is MB, as in sbatch --mem ('0', all of a node: 0)."""
    unit = size[-1] if size[-1] in "KMGT" else "M"
    n = int(size[:-1] if size[-1] in "KMGT" else size)
    return {"K": n // 1024, "M": n, "G": n * 1024, "T": n * 1024 ** 2}[unit]


WHOLE_NODE = "0"
"""`--mem=0`: every byte of memory of each node of the component (Slurm's meaning)."""


def _times(size: str, k: int) -> str:
    unit = size[-1] if size[-1] in "KMGT" else ""
    return f"{int(size[:-1] if unit else size) * k}{unit or 'M'}"


def auto_mem(cfg: Config, gpus_per_node: int, tasks_per_node: int, cpus_per_task: int) -> str:
    """The `--mem` of a component whose `mem` is auto: with GPUs, its GPUs on a node x
    `slurm.mem_per_gpu` (what its ranks keep in host memory, pinned staging, vLLM's swap
    space, parked training states, grows with the GPUs, not the CPUs); without, its CPUs on
    a node x `slurm.mem_per_cpu`, so CPU ranks share nodes as their CPUs allow. The one rule:
    the scripts ask for it and `simulate memory` checks each node against it."""
    if gpus_per_node:
        return _times(cfg.slurm.mem_per_gpu, gpus_per_node)
    return _times(cfg.slurm.mem_per_cpu, tasks_per_node * cpus_per_task)


def component_mem(cfg: Config, c: Component) -> str:
    """The `--mem` (per node) of het component `c`: its `mem`, or `auto_mem`."""
    if c.slurm.mem != "auto":
        return c.slurm.mem
    return auto_mem(cfg, c.slurm.gpus_per_node, c.tasks_per_node, c.slurm.cpus_per_task)


def single_component(cfg: Config, comps: Sequence[Component]) -> SlurmComponent:
    """All ranks in one allocation: the nodes of the rollout and trainer components (the
    orchestrator is one CPU rank that fits beside them), the largest per-task CPUs,
    per-node GPUs and set memory of them all (none set: `auto_mem` of the allocation), the (last)
    trainer component's partition and sbatch_options."""
    trainer = last_trainer(comps)
    nodes = sum(c.slurm.nodes for c in comps[1:])
    gpus, cpus = max(c.slurm.gpus_per_node for c in comps), max(c.slurm.cpus_per_task for c in comps)
    per_node = -(-sum(c.ntasks for c in comps) // nodes)
    mems = [c.slurm.mem for c in comps if c.slurm.mem != "auto"]
    if not mems:
        mem = auto_mem(cfg, gpus, per_node, cpus)
    else:
        mem = WHOLE_NODE if WHOLE_NODE in mems else max(mems, key=mem_mb)
    return SlurmComponent(
        nodes=nodes, gpus_per_node=gpus, cpus_per_task=cpus, mem=mem,
        partition=trainer.slurm.partition,
        sbatch_options=list(trainer.slurm.sbatch_options))


def layout_from_config(cfg: Config, pools: Sequence[Pool], groups: Sequence[Group]) -> RankLayout:
    """Pure: the layout of the config's pools, trainer groups and tool ranks
    (below). Without rollout.pools / trainer.named_groups /
    tools.ranks it is the three-component layout."""
    t = cfg.tools.ranks
    if not cfg.rollout.pools and not cfg.trainer.named_groups:
        return RankLayout(cfg.rollout.replicas, cfg.num_trainer_groups, cfg.trainer.ranks_per_group,
                          tool_ranks=t)
    return RankLayout.of([p.replicas for p in pools], [g.ranks for g in groups],
                         bool(cfg.rollout.pools), bool(cfg.trainer.named_groups), t)
