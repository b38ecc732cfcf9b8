"""The systems FlexMARL is compared with, as simulated systems: the same orchestrator,
workflow and cost model, with the allocation, barriers and weight movement each system's
code and paper describe (docs/baselines.md has the sources).

- `verl`: a single-controller synchronous loop (verl's RayPPOTrainer: generate the whole batch,
  then train, then push weights) on the config's own disaggregated allocation, without load
  balancing: `run.mode=sync`, `pipeline.load_balance=false`.
- `marti`: MARTI (TsinghuaC3I/MARTI, built on OpenRLHF): every agent its own equal share of the
  nodes, where its vLLM engines and its DeepSpeed trainer are colocated (`--colocate_all_models`,
  `--vllm_enable_sleep`, `--deepspeed_enable_sleep`), a synchronous loop (the workflow's whole
  batch, then every agent trains, then NCCL weight sync to its engines). Each step each agent
  wakes its trainer (its state from host memory), puts its engines to sleep (weights to host),
  and back after the optimizer step: four host<->device moves charged on its first and last
  micro-batch (`Colocated`).
- `mas-rl`: agents time-share the whole allocation one at a time (one pool serving every
  agent, all its replicas serving one agent until that agent has nothing pending or in
  flight, `pipeline.one_agent_at_a_time`; each switch a weight load; one trainer group per model
  class, the agents' states swapped through it so they train one after another), colocated
  like MARTI, synchronous. No public code of the paper's MAS-RL was found: this is the
  sequential, time-shared design the paper's description of "existing frameworks" implies.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import yaml

from flexmarl_hpc.config.plan import Plan
from flexmarl_hpc.sim.hardware import HardwareProfile
from flexmarl_hpc.sim.plan import replica_widths
from flexmarl_hpc.sim.plan_config import CPUS_PER_DEVICE, config_classes

BASELINES = ("verl", "marti", "mas-rl")
SYNC_NO_LB = ["run.mode=sync", "pipeline.load_balance=false"]


def _slurm(nodes: int, dpn: int, cpus: int) -> dict:
    return {"nodes": nodes, "gpus_per_node": dpn, "cpus_per_task": cpus}


def _group(plan: Plan, agent: str) -> tuple[int, int]:
    """(tensor_parallel, pipeline_parallel) of the config's trainer group of `agent`."""
    g = next(g for g in plan.groups if agent in g.agents)
    return g.tensor_parallel, 1


def _pool_width(plan: Plan, agent: str) -> int:
    """Devices per replica of the config's pool serving `agent` (the systems compared use the
    same engine width where it fits)."""
    return next(p.gpus_per_replica for p in plan.pools if agent in p.agents)


def marti_fragment(plan: Plan, hw: HardwareProfile, nodes: int) -> dict:
    """Per agent an equal share of `nodes`: a pool of replicas and a trainer group on the same
    nodes (colocated: `colocated_pairs` says which)."""
    agents, dpn = plan.cfg.agent_names, hw.devices_per_node
    each = nodes // len(agents)
    if each < 1:
        raise ValueError(f"marti: {len(agents)} agents need >= 1 node each, got {nodes} nodes")
    classes = {a: c.cls.model for c in config_classes(plan) for a in c.agents}
    pools, groups = [], []
    for a in agents:
        g = max(replica_widths(hw, classes[a])[0], _pool_width(plan, a))
        tp, _ = _group(plan, a)
        pools.append({"name": a, "replicas": each * dpn // g, "gpus_per_replica": g, "gpu_memory_gb": hw.hbm_gb,
                      "agents": [a], "slurm": _slurm(each, dpn, CPUS_PER_DEVICE * g)})
        groups.append({"name": a, "agents": [a], "ranks": each * dpn, "tensor_parallel": tp,
                       "pipeline_parallel": 1, "backend": "megatron", "slurm": _slurm(each, dpn, CPUS_PER_DEVICE)})
    return {"rollout": {"pools": pools}, "trainer": {"named_groups": groups, "groups": 0},
            "run": {"mode": "sync"}, "pipeline": {"load_balance": False}}


def masrl_fragment(plan: Plan, hw: HardwareProfile, nodes: int) -> dict:
    """One pool of every node serving every agent, load balancing on (replicas follow the
    running turn's agent); one trainer group per model class on the pool's first nodes
    (colocated), its agents' states swapped through it."""
    dpn = hw.devices_per_node
    classes = config_classes(plan)
    width = max(max(replica_widths(hw, c.cls.model)[0], _pool_width(plan, c.agents[0])) for c in classes)
    pool = {"name": "all", "replicas": nodes * dpn // width, "gpus_per_replica": width, "gpu_memory_gb": hw.hbm_gb,
            "agents": list(plan.cfg.agent_names), "slurm": _slurm(nodes, dpn, CPUS_PER_DEVICE * width)}
    groups = []
    for c in classes:
        tp, _ = _group(plan, c.agents[0])
        size = math.ceil(16 * c.cls.model.params / (hw.hbm_bytes * 0.6 * dpn))     # nodes holding the state
        groups.append({"name": c.cls.name, "agents": list(c.agents), "ranks": max(size, 1) * dpn,
                       "tensor_parallel": tp, "pipeline_parallel": 1, "backend": "megatron",
                       "slurm": _slurm(max(size, 1), dpn, CPUS_PER_DEVICE), "swap": c.cls.name})
    return {"rollout": {"pools": [pool]}, "trainer": {"named_groups": groups, "groups": 0},
            "run": {"mode": "sync"}, "pipeline": {"load_balance": True, "swap_states": True,
                                                   "one_agent_at_a_time": True}}


FRAGMENTS: dict[str, Callable[[Plan, HardwareProfile, int], dict]] = {
    "marti": marti_fragment, "mas-rl": masrl_fragment}
"""Baselines whose allocation differs from the config's (verl keeps the config's)."""


def colocated_pairs(frag: dict) -> list[tuple[int, int]]:
    """(pool index, group index) pairs that share nodes in a baseline's fragment: MARTI's
    agent-by-agent, MAS-RL's groups on the one pool."""
    pools = [p["name"] for p in frag["rollout"]["pools"]]
    groups = [g["name"] for g in frag["trainer"]["named_groups"]]
    if len(pools) == 1:
        return [(0, j) for j in range(len(groups))]
    return [(pools.index(g), j) for j, g in enumerate(groups) if g in pools]


class Colocated:
    """A cost (sim.driver.ModelledCost or sim.costs.CostModel) plus a colocated system's
    per-step moves: on an agent's first micro-batch its trainer state comes from host memory
    and its engines' weights go there; on its last, the reverse (MARTI's and verl's sleep /
    wake of the hybrid engine)."""

    def __init__(self, cost, hw: HardwareProfile, replica_width: Callable[[str], int]) -> None:
        self.cost, self.hw, self.width = cost, hw, replica_width
        self.first: dict[str, bool] = {}

    def __getattr__(self, name):
        return getattr(self.cost, name)

    def engine_move_s(self, agent: str) -> float:
        """The agent's engine weights to or from host memory, each replica's devices at once."""
        eff = self.hw.efficiency
        return self.cost.weight_bytes(agent) / (self.width(agent) * self.hw.host_device_bandwidth * eff.link)

    def train_s(self, agent, tokens, optimizer_step=True) -> float:
        t = self.cost.train_s(agent, tokens, optimizer_step)
        if self.first.get(agent, True):
            t += self.cost.swap_s(agent, self.cost.state_bytes(agent)) + self.engine_move_s(agent)
        self.first[agent] = optimizer_step              # the next micro-batch starts a step
        if optimizer_step:
            t += self.cost.swap_s(agent, self.cost.state_bytes(agent)) + self.engine_move_s(agent)
        return t


def system_config(raw: dict, system: str, hw: HardwareProfile, overrides: list[str], folder: Path,
                  nodes: int = 0):
    """(Plan, colocated pairs) of `system` from the config dict `raw` (written to
    folder/config.yaml): a baseline's allocation of the config's nodes (or `nodes`) pasted
    in, then `overrides` and the system's own (a baseline's, or a FlexMARL variant's
    `extra` as the caller gives them in `overrides`)."""
    from flexmarl_hpc.config.load import load_plan
    from flexmarl_hpc.sim.plan_config import merge_fragment
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    pairs: list = []
    if system in FRAGMENTS:
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        base = load_plan(str(path), list(overrides))
        have = nodes or _config_nodes(base)
        frag = FRAGMENTS[system](base, hw, have)
        raw, pairs = merge_fragment(raw, frag), colocated_pairs(frag)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    extra = SYNC_NO_LB if system == "verl" else []
    return load_plan(str(path), [*overrides, *extra]), pairs


def _config_nodes(plan: Plan) -> int:
    """Nodes of the config's pools and groups (the orchestrator's not counted)."""
    return sum(p.slurm.nodes for p in plan.pools) + sum(g.slurm.nodes for g in plan.groups)


def colocated_run(plan: Plan, cost, hw: HardwareProfile, pairs: list[tuple[int, int]]):
    """(cost wrap, physical devices) of a colocated baseline: its per-step moves, and the pool
    devices only (its trainers run on them); (None, 0) when nothing is colocated."""
    if not pairs:
        return None, 0
    widths = {a: cost.layout(a).gpus_per_replica for a in plan.cfg.agent_names}
    devices = sum(p.replicas * p.gpus_per_replica for p in plan.pools)
    return (lambda c: Colocated(c, hw, widths.__getitem__)), devices
