"""Allocation plans in a config's own terms (pure: no orchestrator, no files).

`simulate plan CONFIG --nodes N` reads the agent classes from the config (agents grouped by
model shape), ranks splits with the closed-form planner (sim/plan.py), and turns a plan back
into the config's `rollout.pools` / `trainer.named_groups`, each with its own `slurm:`
component, naming the config's real agents:

    classes = config_classes(plan)                     # plan: config.plan.resolve(cfg)
    plans = rank_plans(hw, [c.cls for c in classes], plan_workload(cfg), nodes=plan_nodes(cfg, 48))
    frag = fragment(plans[0], hw, classes, cfg)        # paste into the config, or:
    data = merge_fragment(raw_config_dict, frag)       # a config dict that validates
"""
from __future__ import annotations

import copy
import dataclasses
import os
import types
from dataclasses import dataclass

import yaml

from flexmarl_hpc.config.validate import NAME_RE
from flexmarl_hpc.config.schema import Config
from flexmarl_hpc.config.load import to_dict
from flexmarl_hpc.config.plan import Plan
from flexmarl_hpc.sim.costs import ModelShape, shape_from_model_args
from flexmarl_hpc.sim.driver import QWEN_VOCAB
from flexmarl_hpc.sim.hardware import HardwareProfile
from flexmarl_hpc.sim.plan import AgentClass, Allocation, Workload, group_sizes, replica_widths

CPUS_PER_DEVICE = 4
"""cpus_per_task per accelerator a task holds (the paper configs' choice: 4 for a trainer
rank or a 1-device replica, 16 for a 4-device replica)."""


@dataclass(frozen=True)
class ConfigClass:
    """An agent class as the planner sees it, and the config agents it stands for."""

    cls: AgentClass
    """Class name (pool name), model shape and agent count for the planner."""
    agents: tuple[str, ...]
    """The config's agents of this shape, in workflow order."""


def config_classes(plan: Plan, vocab: int = QWEN_VOCAB) -> list[ConfigClass]:
    """Agents grouped by model shape, in order of first appearance. A class is named after
    the config pool serving exactly its agents, else their common name prefix, else `cN`."""
    cfg = plan.cfg
    shapes: dict[ModelShape, list[str]] = {}
    for a in cfg.agent_names:
        m = types.SimpleNamespace(**{**to_dict(cfg.model_for(a)), "vocab_size": vocab})
        key = dataclasses.replace(shape_from_model_args(m, "", 2), name="")
        shapes.setdefault(key, []).append(a)
    pools = {frozenset(p.agents): p.name for p in plan.pools} if cfg.rollout.pools else {}
    out: list[ConfigClass] = []
    for i, (shape, agents) in enumerate(shapes.items()):
        used = {c.cls.name for c in out}
        name = pools.get(frozenset(agents)) or _prefix(agents)
        if not name or name in used:
            name = next(f"c{j}" for j in range(i, i + len(out) + 2) if f"c{j}" not in used)
        model = dataclasses.replace(shape, name=f"{agents[0]}'s model ({shape.params / 1e9:.1f}B)")
        out.append(ConfigClass(AgentClass(name, model, len(agents)), tuple(agents)))
    return out


def _prefix(agents: list[str]) -> str:
    """`shop14_0, shop14_1` -> `shop14` (empty when no usable common prefix)."""
    p = os.path.commonprefix(agents).rstrip("_-.+") if len(agents) > 1 else agents[0]
    return p if NAME_RE.match(p or "-") else ""


def plan_workload(cfg: Config) -> Workload:
    """The planner's workload from the config: an agent's global batch is inputs_per_step
    times the branching up to its turn (the largest agent's), micro-batches are the trainer's.
    An episode workflow's calls are known only when it runs: one call per agent per episode
    (inputs_per_step x group_size) is assumed, as the paper's text episode makes."""
    if cfg.workflow.episode:
        return Workload(global_batch=cfg.workflow.inputs_per_step * cfg.workflow.group_size,
                        micro_batch=cfg.trainer.micro_batch_size)
    batch, paths = {}, cfg.workflow.inputs_per_step
    for t in cfg.workflow.turns:
        paths *= t.samples
        batch[t.agent] = batch.get(t.agent, 0) + paths
    return Workload(global_batch=max(batch.values()), micro_batch=cfg.trainer.micro_batch_size)


def plan_nodes(cfg: Config, nodes: int) -> int:
    """Nodes left for pools and groups once the orchestrator's component has its own."""
    return nodes - cfg.slurm.orchestrator.nodes


def fragment(plan: Allocation, hw: HardwareProfile, classes: list[ConfigClass], cfg: Config) -> dict:
    """The plan as config sections: `rollout.pools` and `trainer.named_groups` with their
    `slurm:` components (nodes x hw.devices_per_node, one task per device or replica), plus
    `pipeline.swap_states` when a class has fewer groups than agents (those groups share
    the class name as swap label) and `trainer.groups: 0` when the config set it."""
    by_name = {c.cls.name: c for c in classes}
    dpn = hw.devices_per_node
    pools, groups = [], []
    for name, a in plan.allocs:
        agents = list(by_name[name].agents)
        pools.append({"name": name, "replicas": a.pool_nodes * dpn // a.gpus_per_replica,
                      "gpus_per_replica": a.gpus_per_replica, "gpu_memory_gb": hw.hbm_gb, "agents": agents,
                      "slurm": _slurm(a.pool_nodes, dpn, CPUS_PER_DEVICE * a.gpus_per_replica)})
        swap = a.groups < len(agents)
        for j in range(a.groups):
            mine = agents[j::a.groups]
            group = {"name": f"{name}_g{j}" if swap else mine[0], "agents": mine,
                     "ranks": a.group_nodes * dpn, "tensor_parallel": a.trainer_tp, "pipeline_parallel": 1,
                     "backend": "megatron" if a.trainer_tp > 1 else cfg.trainer.backend,
                     "slurm": _slurm(a.group_nodes, dpn, CPUS_PER_DEVICE)}
            if swap:
                group["swap"] = name
            groups.append(group)
    out: dict = {"rollout": {"pools": pools}, "trainer": {"named_groups": groups}}
    if cfg.trainer.groups:
        out["trainer"]["groups"] = 0
    if any(a.groups < len(by_name[n].agents) for n, a in plan.allocs):
        out["pipeline"] = {"swap_states": True}
    return out


def distinct(plans: list[Allocation], k: int) -> list[Allocation]:
    """The first `k` plans of distinct shapes (per class: replica width, group count, group
    size), each with its best pool split. Splits of one shape that differ by a pool node sit
    inside the closed form's tie band and inside a few simulated steps' noise, so simulating
    several of them would spend the simulator on nothing."""
    out, seen = [], set()
    for p in plans:
        key = tuple((n, a.gpus_per_replica, a.groups, a.group_nodes) for n, a in p.allocs)
        if key not in seen:
            seen.add(key)
            out.append(p)
            if len(out) == k:
                break
    return out


def _slurm(nodes: int, gpus_per_node: int, cpus_per_task: int) -> dict:
    return {"nodes": nodes, "gpus_per_node": gpus_per_node, "cpus_per_task": cpus_per_task}


def fragment_nodes(frag: dict) -> int:
    """Nodes the fragment's components ask for (the orchestrator's not included)."""
    return (sum(p["slurm"]["nodes"] for p in frag["rollout"]["pools"])
            + sum(g["slurm"]["nodes"] for g in frag["trainer"]["named_groups"]))


def merge_fragment(data: dict, frag: dict) -> dict:
    """A copy of the config dict `data` with the fragment pasted in: its mappings merge key by
    key, its lists (pools, named_groups) replace the config's."""
    out = copy.deepcopy(data)
    _merge(out, frag)
    return out


def _merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = copy.deepcopy(v)


def describe_alloc(plan: Allocation, hw: HardwareProfile) -> list[str]:
    """One short line per class: its pool and its groups."""
    out = []
    for name, a in plan.allocs:
        replicas = a.pool_nodes * hw.devices_per_node // a.gpus_per_replica
        out.append(f"{name}: pool {a.pool_nodes} nodes = {replicas} replicas x {a.gpus_per_replica} dev; "
                   f"{a.groups} group(s) x {a.group_nodes} nodes (TP {a.trainer_tp})")
    return out


def describe_classes(classes: list[ConfigClass]) -> str:
    """`p32 = 3 x 32.8B (shop32_0..shop32_2), ...`"""
    return ", ".join(f"{c.cls.name} = {c.cls.count} x {c.cls.model.params / 1e9:.3g}B "
                     f"({c.agents[0]}{'..' + c.agents[-1] if len(c.agents) > 1 else ''})" for c in classes)



def min_nodes(hw: HardwareProfile, classes: list[ConfigClass], cfg: Config) -> int:
    """Fewest nodes (the orchestrator's included) that hold one pool node and the smallest
    trainer group of every class; ValueError naming the agent whose model fits no node."""
    need = cfg.slurm.orchestrator.nodes
    for c in classes:
        sizes = group_sizes(hw, c.cls.model, 10**6) if replica_widths(hw, c.cls.model) else []
        if not sizes:
            a = c.agents[0]
            where = f"agents.{a}" if a in cfg.agents else "model"
            raise ValueError(f"{where}: the {c.cls.model.params / 1e9:.1f}B model of agent {a!r} fits "
                             f"no replica or trainer group on a {hw.name} node "
                             f"({hw.devices_per_node} x {hw.hbm_gb:g} GB)")
        need += 1 + sizes[0]
    return need


def fragment_yaml(frag: dict, header: list[str] = ()) -> str:
    """The fragment as YAML in the paper configs' style: one flow mapping per pool/group."""
    lines = [f"# {h}" for h in header]
    for section, body in frag.items():
        lines.append(f"{section}:")
        for k, v in body.items():
            if isinstance(v, list):
                lines.append(f"  {k}:")
                lines += [f"    - {_flow(item)}" for item in v]
            else:
                lines.append(f"  {k}: {_flow(v)}")
    return "\n".join(lines) + "\n"


def _flow(value) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**9).strip()
    return text.removesuffix("...").strip()      # a bare scalar ends its document with '...'
