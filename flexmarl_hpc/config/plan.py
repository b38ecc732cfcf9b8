"""The resolved plan of a run: the config and everything derived from it, computed once.

    plan = load_plan("configs/local.yaml", ["run.steps=4"])    # config/load.py
    plan.pools, plan.groups, plan.trainers[g], plan.layout, plan.sync_groups
    plan.steps_in_flight, plan.bytes_per_weight(cuda=True), plan.components

`resolve(cfg)` runs the checks that read the pools and groups (validate_resources) on the
very lists it keeps, then lays out ranks, sync groups and het components from them. The CLIs
resolve once and hand the Plan down (ranks, orchestrator, simulator, preflight, `simulate
memory`); nothing else calls config/resources.py's resolving functions
(tests/unit/test_plan.py scans for it). Pure: no MPI, no torch, no Slurm.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flexmarl_hpc.config.frozen import freeze
from flexmarl_hpc.config.layout import TOOLS, RankLayout
from flexmarl_hpc.config.resources import (Component, Group, Pool, components, group_trainer_config,
                                           layout_from_config, replica_bytes_per_weight, rollout_pools,
                                           single_component, steps_in_flight, trainer_groups)
from flexmarl_hpc.config.schema import Config, SlurmComponent, TrainerConfig
from flexmarl_hpc.config.sync_groups import SyncGroup, sync_groups
from flexmarl_hpc.config.validate import validate_resources


@dataclass(frozen=True)
class Plan:
    cfg: Config
    """The validated config the plan was resolved from, a read-only copy (config/frozen.py:
    frozen dataclasses, lists and mappings that refuse changes): the fields below were
    derived from it once, so it cannot drift from them."""
    pools: tuple[Pool, ...]
    """Rollout pools in rank order (one `rollout` pool without rollout.pools)."""
    groups: tuple[Group, ...]
    """Trainer groups in rank order (trainer.groups uniform groups without named_groups)."""
    trainers: tuple[TrainerConfig, ...]
    """Each group's trainer section: its own backend and TP/PP/ranks (index: group)."""
    layout: RankLayout
    """Which world rank plays which role, tool ranks included."""
    sync_groups: tuple[SyncGroup, ...]
    """Every (trainer group, pool) weight-sync communicator, in the order ranks make them."""
    components: tuple[Component, ...]
    """Het-job components in rank order (the job scripts, preflight's capacity check)."""
    steps_in_flight: int
    """Consecutive steps that may hold samples at once (resources.steps_in_flight)."""
    _bytes_per_weight: tuple[int, int]
    """Bytes of one weight on a rollout replica on (CPU, GPU)."""

    def bytes_per_weight(self, cuda: bool = True) -> int:
        """Bytes one weight takes on a rollout replica (resources.replica_bytes_per_weight)."""
        return self._bytes_per_weight[bool(cuda)]

    def trainer(self, group: int) -> TrainerConfig:
        return self.trainers[group]

    @property
    def single(self) -> SlurmComponent:
        """All ranks in one allocation (`--single`, resources.single_component): derived on
        reading, after validate_slurm checked the `slurm:` section it merges (load_config
        does not check it: a config that is never submitted may leave it unset)."""
        return single_component(self.cfg, self.components)

    def in_process(self) -> "Plan":
        """The plan without tool ranks: the simulator runs tools in the orchestrator's
        process pool, so its world ends after the trainer groups."""
        if not self.layout.tool_ranks:
            return self
        return dataclasses.replace(self, layout=dataclasses.replace(self.layout, tool_ranks=0),
                                   components=tuple(c for c in self.components if c.role != TOOLS))


def resolve(cfg: Config) -> Plan:
    """The plan of a config that passed config.validate.validate (load_config runs it):
    raises ConfigError naming the field where the pools or groups do not hold together."""
    pools, groups = tuple(rollout_pools(cfg)), tuple(trainer_groups(cfg))
    validate_resources(cfg, pools, groups)
    layout = layout_from_config(cfg, pools, groups)
    comps = tuple(components(cfg, pools, groups))
    return freeze(Plan(          # read-only to the last list (config/frozen.py): nothing re-derives
        cfg=cfg, pools=pools, groups=groups,
        trainers=tuple(group_trainer_config(cfg, g) for g in groups),
        layout=layout, sync_groups=tuple(sync_groups(pools, groups, layout)),
        components=comps,
        steps_in_flight=steps_in_flight(cfg.pipeline.max_staleness),
        _bytes_per_weight=(replica_bytes_per_weight(cfg.rollout, False), replica_bytes_per_weight(cfg.rollout, True))))


def component_table(plan: Plan) -> str:
    """The dry-run table: component, ranks, nodes, GPUs, agents."""
    cfg = plan.cfg
    rows = [("#", "component", "ranks", "nodes", "GPUs", "shape", "agents")]
    pools = {f"pool {p.name}" for p in plan.pools}
    groups = {f"group {g.name}": g for g in plan.groups}
    for i, c in enumerate(plan.components):
        last = c.first_rank + c.ntasks - 1
        ranks = f"{c.first_rank}" if c.ntasks == 1 else f"{c.first_rank}-{last}"
        gpus = c.slurm.nodes * c.slurm.gpus_per_node
        if c.name in groups:
            shape = groups[c.name].describe()
        elif c.name in pools or c.name == "rollout":
            shape = f"{c.ntasks} replicas x {c.gpus_per_task} GPU"
        elif c.name == "trainer":
            shape = f"{cfg.num_trainer_groups} groups x {plan.groups[0].describe()}"
        elif c.role == TOOLS:
            shape = f"{c.ntasks} ranks x {cfg.tools.workers} tools.workers"
        else:
            shape = "-"
        rows.append((str(i), c.name, ranks, str(c.slurm.nodes), str(gpus), shape, ",".join(c.agents) or "-"))
    total_nodes = sum(c.slurm.nodes for c in plan.components)
    total_gpus = sum(c.slurm.nodes * c.slurm.gpus_per_node for c in plan.components)
    world = sum(c.ntasks for c in plan.components)
    rows.append(("", "total", str(world), str(total_nodes), str(total_gpus), "", ""))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)
