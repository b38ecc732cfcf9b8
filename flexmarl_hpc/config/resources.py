"""Heterogeneous resources: rollout pools and trainer groups, resolved from the config.

A config either lists them (`rollout.pools`, `trainer.named_groups`: each its own het-job
component) or describes the uniform case of earlier versions (`rollout.replicas` in one
pool, `trainer.groups` x `trainer.ranks_per_group` in one component); both resolve to the
same `Pool` / `Group` lists here, so the layout, the job script, the scheduler and the
trainers read one description. Everything is pure (no MPI, no Slurm).

    pools, groups = rollout_pools(cfg), trainer_groups(cfg)
    for c in components(cfg): print(c.name, c.ntasks, c.agents)     # het-job component order
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flexmarl_hpc.config.schema import NAME_RE, Config, ConfigError, ModelConfig, SlurmComponent, TrainerConfig

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


def weight_gb(cfg: Config, agent: str) -> float:
    """GB of an agent's weights on a replica (bf16 unless rollout.dtype says fp32)."""
    width = 4 if cfg.rollout.dtype == "fp32" else 2
    return param_count(cfg.model_for(agent)) * width / 1e9


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
                        f"rollout.pools[{i}]"))
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


def swap_peers(groups: list[Group], g: int) -> list[int]:
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


def components(cfg: Config) -> list[Component]:
    """Het-job components in rank order: orchestrator, pools..., trainer groups..."""
    s = cfg.slurm
    out = [Component("orchestrator", "slurm.orchestrator", s.orchestrator, 1, 0, 0, ())]
    rank = 1
    pools = rollout_pools(cfg)
    if cfg.rollout.pools:
        for p in pools:
            out.append(Component(f"pool {p.name}", f"{p.where}.slurm", p.slurm, p.replicas,
                                 p.gpus_per_replica, rank, p.agents))
            rank += p.replicas
    else:
        out.append(Component("rollout", "slurm.rollout", s.rollout, pools[0].replicas,
                             pools[0].gpus_per_replica, rank, pools[0].agents))
        rank += pools[0].replicas
    groups = trainer_groups(cfg)
    if cfg.trainer.named_groups:
        for g in groups:
            out.append(Component(f"group {g.name}", f"{g.where}.slurm", g.slurm, g.ranks, 1, rank, g.agents))
            rank += g.ranks
    else:
        out.append(Component("trainer", "slurm.trainer", s.trainer, sum(g.ranks for g in groups), 1,
                             rank, tuple(cfg.agent_names)))
    return out


def component_table(cfg: Config) -> str:
    """The dry-run table: component, ranks, nodes, GPUs, agents."""
    rows = [("#", "component", "ranks", "nodes", "GPUs", "shape", "agents")]
    pools = {f"pool {p.name}": p for p in rollout_pools(cfg)}
    groups = {f"group {g.name}": g for g in trainer_groups(cfg)}
    for i, c in enumerate(components(cfg)):
        last = c.first_rank + c.ntasks - 1
        ranks = f"{c.first_rank}" if c.ntasks == 1 else f"{c.first_rank}-{last}"
        gpus = c.slurm.nodes * c.slurm.gpus_per_node
        if c.name in groups:
            shape = groups[c.name].describe()
        elif c.name in pools or c.name == "rollout":
            shape = f"{c.ntasks} replicas x {c.gpus_per_task} GPU"
        elif c.name == "trainer":
            g0 = trainer_groups(cfg)[0]
            shape = f"{cfg.num_trainer_groups} groups x {g0.describe()}"
        else:
            shape = "-"
        rows.append((str(i), c.name, ranks, str(c.slurm.nodes), str(gpus), shape, ",".join(c.agents) or "-"))
    total_nodes = sum(c.slurm.nodes for c in components(cfg))
    total_gpus = sum(c.slurm.nodes * c.slurm.gpus_per_node for c in components(cfg))
    world = sum(c.ntasks for c in components(cfg))
    rows.append(("", "total", str(world), str(total_nodes), str(total_gpus), "", ""))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


# ---------------------------------------------------------------------------------------
# validation (called by config.validate, before any rank starts)
# ---------------------------------------------------------------------------------------
def _need(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{where}: {msg}")


def _check_names(items: list, kind: str, where: str, agents: list[str]) -> None:
    seen = set()
    for i, it in enumerate(items):
        if it.name:
            _need(bool(NAME_RE.match(it.name)), f"{where}[{i}].name",
                  f"expected letters, digits, _ . + - (it labels a het component), got {it.name!r}")
            _need(it.name not in seen, f"{where}[{i}].name", f"{kind} name {it.name!r} is used twice")
            seen.add(it.name)
        for a in it.agents:
            _need(a in agents, f"{where}[{i}].agents", f"no agent {a!r} in workflow.turns (agents are {agents})")


def _validate_pools(cfg: Config) -> None:
    agents = cfg.agent_names
    _check_names(cfg.rollout.pools, "pool", "rollout.pools", agents)
    for i, p in enumerate(cfg.rollout.pools):
        w = f"rollout.pools[{i}]"
        _need(p.replicas >= 1, f"{w}.replicas", f"expected >= 1, got {p.replicas}")
        _need(p.gpus_per_replica >= 1, f"{w}.gpus_per_replica", f"expected >= 1, got {p.gpus_per_replica}")
        _need(p.gpu_memory_gb >= 0, f"{w}.gpu_memory_gb", f"expected >= 0, got {p.gpu_memory_gb}")
        cap = FIT_FRACTION * p.gpus_per_replica * p.gpu_memory_gb
        for a in p.agents:
            _need(fits(cfg, a, p.gpus_per_replica, p.gpu_memory_gb), f"{w}.gpus_per_replica",
                  f"pool too small for agent {a!r}: its model's weights take {weight_gb(cfg, a):.1f} GB, "
                  f"a replica of {p.gpus_per_replica} x {p.gpu_memory_gb:g} GB GPUs holds {cap:.1f} GB "
                  f"({FIT_FRACTION:.0%}); raise gpus_per_replica or serve {a!r} from a bigger pool")
        if cfg.rollout.backend == "vllm" and p.slurm.gpus_per_node:
            for a in rollout_pools(cfg)[i].agents:
                m = cfg.model_for(a)
                _need(m.num_heads % p.gpus_per_replica == 0 and m.num_kv_heads % p.gpus_per_replica == 0,
                      f"{w}.gpus_per_replica", f"vLLM's tensor parallelism {p.gpus_per_replica} does not "
                      f"divide the {m.num_heads} heads / {m.num_kv_heads} KV heads of agent {a!r}")
    served = {a for p in rollout_pools(cfg) for a in p.agents}
    for a in agents:
        _need(a in served, "rollout.pools", f"no pool can serve agent {a!r} (its weights take "
              f"{weight_gb(cfg, a):.1f} GB; list it in a pool's agents, or add a pool it fits)")


def _validate_groups(cfg: Config) -> None:
    tr, agents = cfg.trainer, cfg.agent_names
    named = tr.named_groups
    if named:
        _need(tr.groups == 0, "trainer.groups", "expected 0 with trainer.named_groups (the list sets the groups)")
        _check_names(named, "group", "trainer.named_groups", agents)
        owner: dict[str, int] = {}
        for i, g in enumerate(named):
            for a in g.agents:
                _need(a not in owner, f"trainer.named_groups[{i}].agents",
                      f"agent {a!r} is already on trainer.named_groups[{owner.get(a)}]")
                owner[a] = i
        for a in agents:
            _need(a in owner, "trainer.named_groups", f"agent {a!r} has no trainer group; list it in "
                  "one group's agents")
    groups = trainer_groups(cfg)
    for i, g in enumerate(groups):
        w = g.where
        for key in ("ranks", "tensor_parallel", "pipeline_parallel"):
            _need(getattr(g, key) >= 1, f"{w}.{key}" if named else f"trainer.{_uniform(key)}",
                  f"expected >= 1, got {getattr(g, key)}")
        mp = g.tensor_parallel * g.pipeline_parallel
        _need(g.ranks % mp == 0, f"{w}.ranks" if named else "trainer.ranks_per_group",
              f"expected a multiple of tensor_parallel x pipeline_parallel = {mp}, got {g.ranks}")
        _need(g.backend == "megatron" or mp == 1, f"{w}.tensor_parallel" if named else "trainer.tensor_parallel",
              "tensor/pipeline parallelism needs backend megatron")
        if named:
            _need(bool(g.agents) or bool(g.swap), f"{w}.agents",
                  "expected at least one agent (or a swap label, to host agents of its swap domain)")
            _need(len(g.agents) <= 1 and not g.swap or cfg.pipeline.swap_states, "pipeline.swap_states",
                  f"{w} holds {len(g.agents)} agents / swap label {g.swap!r}: its agents take turns, "
                  "which needs pipeline.swap_states=true")
        for a in _domain_agents(groups, i):
            m = cfg.model_for(a)
            tp_where = f"{w}.tensor_parallel" if named else "trainer.tensor_parallel"
            pp_where = f"{w}.pipeline_parallel" if named else "trainer.pipeline_parallel"
            _need(m.num_heads % g.tensor_parallel == 0 and m.num_kv_heads % g.tensor_parallel == 0, tp_where,
                  f"{g.tensor_parallel} does not divide the {m.num_heads} heads / "
                  f"{m.num_kv_heads} KV heads of agent {a!r}")
            _need(m.num_layers % g.pipeline_parallel == 0, pp_where,
                  f"{g.pipeline_parallel} does not divide the {m.num_layers} layers of agent {a!r}")
    for i, g in enumerate(groups):
        for h in swap_peers(groups, i)[1:]:
            _need(groups[h].shape == g.shape, f"{groups[h].where}.swap",
                  f"swap domain {g.swap!r} joins {g.name} ({g.describe()}) and {groups[h].name} "
                  f"({groups[h].describe()}); states swap only between groups of the same shape")


def _uniform(key: str) -> str:
    return {"ranks": "ranks_per_group"}.get(key, key)


def _domain_agents(groups: list[Group], g: int) -> list[str]:
    return [a for h in swap_peers(groups, g) for a in groups[h].agents]


def validate_resources(cfg: Config) -> None:
    _validate_pools(cfg)
    _validate_groups(cfg)

