"""Allocation planning in closed form: how to split N nodes among rollout pools and trainer
groups for classes of agents (e.g. 3 x 32B + 7 x 14B), ranked by a steady-state estimate.

Pure and fast (no orchestrator): it prunes the space before the discrete-event simulator
runs the real orchestrator on the best few. Per class c of `count` agents:

- a rollout pool of `pool_nodes` nodes, replicas of `gpus_per_replica` devices, the
  replicas split evenly among the class's agents (level 1); an agent's batch is spread
  longest-first round-robin over its replicas (level 2, least-loaded routing), so its first
  replica holds the most tokens and the longest response and sets the agent's rollout time;
- `groups` trainer groups of `group_nodes` nodes each: one per agent, or fewer with state
  swapping (each extra resident costs a swap out and in).

Step estimates: `sync` (barrier) = max rollout + max train + max sync (sum of phases);
`flex` (micro-batch pipeline) = max over classes of max(rollout + last micro-batch + optimizer
+ sync, all micro-batches + optimizer + sync) (overlap = max). Agents are assumed to roll
out concurrently (the workflow's turn order is ignored: the simulator does not ignore it).

    plans = rank_plans(hw, [AgentClass("32B", QWEN25_32B, 3), AgentClass("14B", QWEN25_14B, 7)],
                       Workload(), nodes=48)
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from flexmarl_hpc.sim.costs import (TRAIN_STATE_BYTES_PER_PARAM, AgentLayout, CostModel, LengthDistribution,
                                    ModelShape, generate_s)
from flexmarl_hpc.sim.hardware import HardwareProfile


@dataclass(frozen=True)
class AgentClass:
    """Agents sharing one model size (and hence one rollout pool and group shape)."""

    name: str
    """Class label, used as the pool and group name prefix."""
    model: ModelShape
    """The class's model."""
    count: int
    """Agents in the class."""


@dataclass(frozen=True)
class Workload:
    """What one optimizer step of every agent needs (the paper's GRPO set-up by default)."""

    global_batch: int = 64
    """Samples per agent per step."""
    micro_batch: int = 16
    """Samples per micro-batch (the pipeline's unit)."""
    samples_per_prompt: int = 8
    """GRPO group size: branches sharing one prompt's prefill."""
    prompt_tokens: int = 1024
    """Prompt length, tokens (assumption: the paper gives none)."""
    lengths: LengthDistribution = field(default_factory=LengthDistribution)
    """Response lengths (max 8192 in the paper)."""
    seed: int = 0
    """Seed of the response lengths: the same seed ranks the same way."""


@dataclass(frozen=True)
class ClassAlloc:
    """One class's share of the nodes."""

    pool_nodes: int
    gpus_per_replica: int
    groups: int
    group_nodes: int
    trainer_tp: int


@dataclass(frozen=True)
class Allocation:
    """A candidate allocation and its estimates."""

    allocs: tuple[tuple[str, ClassAlloc], ...]
    """(class name, allocation) per class."""
    step_s: dict[str, float]
    """Estimated step time per mode: `sync` and `flex`."""
    utilization: dict[str, float]
    """Busy device-seconds / (devices x step time), per mode."""
    phases: dict[str, dict[str, float]]
    """Per class: rollout, train (all micro-batches + optimizer, swaps included), sync seconds."""
    demand: dict[str, float] = field(default_factory=dict)
    """Per class: the FLOPs one step needs (rollout + training), whatever the allocation."""

    @property
    def nodes(self) -> int:
        return sum(a.pool_nodes + a.groups * a.group_nodes for _, a in self.allocs)

    def shares(self) -> dict[str, tuple[float, float]]:
        """Per class (its share of the step's compute demand, its share of the nodes)."""
        total = sum(self.demand.values()) or 1.0
        return {name: (self.demand.get(name, 0.0) / total, (a.pool_nodes + a.groups * a.group_nodes) / self.nodes)
                for name, a in self.allocs}

    @property
    def mismatch(self) -> float:
        """How far the nodes are from the demand: the sum over classes of |node share - demand
        share| (0: every class gets nodes in proportion to the compute it needs)."""
        return sum(abs(n - d) for d, n in self.shares().values())


def _trainer_fits(hw: HardwareProfile, model: ModelShape, devices: int, tp: int) -> bool:
    """bf16 weights and grads per TP shard (4 bytes/param / tp) plus the distributed
    optimizer's fp32 master and moments (12 / devices) within 60% of the usable memory (the
    rest: activations)."""
    usable = hw.hbm_bytes * hw.efficiency.gpu_memory_utilization
    return 4 * model.params / tp + 12 * model.params / devices <= 0.6 * usable


def _tp_for(hw: HardwareProfile, model: ModelShape, devices: int) -> int:
    """Smallest power-of-two TP (inside a node, dividing the heads) at which the trainer fits;
    data parallelism takes the rest of the devices."""
    tp = 1
    while (not _trainer_fits(hw, model, devices, tp) and tp * 2 <= min(devices, hw.devices_per_node)
           and model.heads % (tp * 2) == 0):
        tp *= 2
    return tp


def replica_widths(hw: HardwareProfile, model: ModelShape) -> list[int]:
    """Replica widths worth trying: the two smallest powers of two that hold the weights
    with room for a KV cache (a quarter of the usable memory at least)."""
    usable = hw.hbm_bytes * hw.efficiency.gpu_memory_utilization
    out, g = [], 1
    while g <= hw.devices_per_node and len(out) < 2:
        if model.weight_bytes <= 0.75 * g * usable:
            out.append(g)
        g *= 2
    return out


def group_sizes(hw: HardwareProfile, model: ModelShape, max_nodes: int) -> list[int]:
    """Nodes per trainer group worth trying: the fewest that hold the training state, and 2x."""
    first = 1
    while not _trainer_fits(hw, model, first * hw.devices_per_node, _tp_for(hw, model, first * hw.devices_per_node)):
        first += 1
        if first > max_nodes:
            return []
    return [n for n in (first, 2 * first) if n <= max_nodes]


class _Estimator:
    """Cached per-class phase times (rollout depends only on the pool, train only on the group)."""

    def __init__(self, hw: HardwareProfile, workload: Workload, classes: list[AgentClass]):
        self.hw, self.wl = hw, workload
        self.classes = {c.name: c for c in classes}
        rng = np.random.default_rng(workload.seed)
        # one batch of lengths per class, shared by every candidate so rankings compare like with like
        self.lengths = {c.name: np.sort(workload.lengths.sample(rng, workload.global_batch))[::-1]
                        for c in classes}
        self.rollout = lru_cache(maxsize=None)(self._rollout)
        self.train = lru_cache(maxsize=None)(self._train)

    def _rollout(self, name: str, pool_nodes: int, g: int) -> tuple[float, float]:
        """(seconds, busy device-seconds) for every agent of the class to roll out its batch."""
        cls, wl = self.classes[name], self.wl
        replicas = pool_nodes * self.hw.devices_per_node // g
        lay = AgentLayout(cls.model, gpus_per_replica=g)
        lengths = self.lengths[name]
        per_agent, rounds = divmod(replicas, cls.count)
        if per_agent == 0:                      # fewer replicas than agents: agents take turns
            per_agent, rounds = 1, math.ceil(cls.count / replicas)
        else:
            rounds = 1
        mine = lengths[::per_agent]             # longest-first round-robin: replica 0's share
        prompts = math.ceil(len(mine) / wl.samples_per_prompt)
        t = rounds * generate_s(self.hw, lay, prompts * wl.prompt_tokens, wl.prompt_tokens, mine, closed_form=True)
        busy = 0.0
        for r in range(min(per_agent, len(lengths))):
            share = lengths[r::per_agent]
            busy += generate_s(self.hw, lay, math.ceil(len(share) / wl.samples_per_prompt) * wl.prompt_tokens,
                               wl.prompt_tokens, share, closed_form=True)
        return t, busy * g * cls.count

    def _train(self, name: str, groups: int, group_nodes: int) -> tuple[float, float, float, float]:
        """(all micro-batches + optimizer incl. swaps, last micro-batch + optimizer, sync, busy)."""
        cls, wl = self.classes[name], self.wl
        devices = group_nodes * self.hw.devices_per_node
        tp = _tp_for(self.hw, cls.model, devices)
        lay = AgentLayout(cls.model, gpus_per_replica=replica_widths(self.hw, cls.model)[0],
                          trainer_devices=devices, trainer_tp=tp)
        cost = CostModel(self.hw, {name: lay})
        mean_tokens = wl.prompt_tokens + float(self.lengths[name].mean())
        n_micro = math.ceil(wl.global_batch / wl.micro_batch)
        micro = cost.train_s(name, int(wl.micro_batch * mean_tokens), optimizer_step=False)
        last = cost.train_s(name, int(wl.micro_batch * mean_tokens))
        per_agent = (n_micro - 1) * micro + last
        residents = math.ceil(cls.count / groups)
        swaps = 2 * (residents - 1) * cost.swap_s(name, TRAIN_STATE_BYTES_PER_PARAM * cls.model.params)
        sync = cost.sync_s(name, cls.model.weight_bytes)
        busy = per_agent * devices * cls.count
        return residents * per_agent + swaps, last, sync, busy

    def demand(self, name: str) -> float:
        """FLOPs one step of the class needs, whatever its allocation: per agent 2P per prompt
        token (prefilled once per query) and per generated token, 6P per trained token."""
        cls, wl = self.classes[name], self.wl
        mean = float(self.lengths[name].mean())
        gen = wl.global_batch * (wl.prompt_tokens / wl.samples_per_prompt + mean)
        return cls.count * cls.model.params * (2 * gen + 6 * wl.global_batch * (wl.prompt_tokens + mean))

    def plan(self, allocs: tuple[tuple[str, ClassAlloc], ...]) -> Allocation:
        phases, sync_parts, flex_parts, busy, demand = {}, [0.0, 0.0, 0.0], [], 0.0, {}
        for name, a in allocs:
            roll, roll_busy = self.rollout(name, a.pool_nodes, a.gpus_per_replica)
            train, last, sync, train_busy = self.train(name, a.groups, a.group_nodes)
            phases[name] = {"rollout": roll, "train": train, "sync": sync}
            sync_parts = [max(sync_parts[0], roll), max(sync_parts[1], train), max(sync_parts[2], sync)]
            flex_parts.append(max(roll + last, train) + sync)
            busy += roll_busy + train_busy
            demand[name] = self.demand(name)
        devices = sum(a.pool_nodes + a.groups * a.group_nodes for _, a in allocs) * self.hw.devices_per_node
        step = {"sync": sum(sync_parts), "flex": max(flex_parts)}
        util = {m: busy / (devices * s) for m, s in step.items()}
        return Allocation(allocs, step, util, phases, demand)


def candidates(hw: HardwareProfile, classes: list[AgentClass], nodes: int,
               swap: bool = True) -> list[tuple[tuple[str, ClassAlloc], ...]]:
    """Every split of exactly `nodes` nodes: per class a replica width, a group size, a group
    count (one per agent, or fewer with swapping) and the pool nodes left over."""
    per_class = []
    for c in classes:
        widths = replica_widths(hw, c.model)
        if not widths:
            raise ValueError(f"class {c.name!r}: {c.model.name} does not fit on a node of {hw.name}")
        opts = []
        for g, gn in itertools.product(widths, group_sizes(hw, c.model, nodes)):
            for k in (range(1, c.count + 1) if swap else [c.count]):
                opts.append((g, gn, k, _tp_for(hw, c.model, gn * hw.devices_per_node)))
        per_class.append(opts)
    out = []
    for choice in itertools.product(*per_class):
        trainer_nodes = sum(k * gn for _, gn, k, _ in choice)
        spare = nodes - trainer_nodes
        if spare < len(classes):
            continue
        # split the spare nodes among the pools (each >= 1 node)
        for cut in itertools.combinations(range(1, spare), len(classes) - 1):
            pools = [b - a for a, b in zip((0,) + cut, cut + (spare,))]
            out.append(tuple((c.name, ClassAlloc(p, g, k, gn, tp))
                             for c, p, (g, gn, k, tp) in zip(classes, pools, choice)))
    return out


def rank_plans(hw: HardwareProfile, classes: list[AgentClass], workload: Workload, nodes: int,
               mode: str = "flex", top: int = 5, swap: bool = True) -> list[Allocation]:
    """The `top` allocations of exactly `nodes` nodes by estimated `mode` step time."""
    if mode not in ("flex", "sync"):
        raise ValueError(f"mode: expected flex or sync, got {mode!r}")
    if nodes < 1:
        raise ValueError(f"nodes: expected >= 1, got {nodes}")
    est = _Estimator(hw, workload, classes)
    plans = [est.plan(a) for a in candidates(hw, classes, nodes, swap)]
    if not plans:
        raise ValueError(f"nodes: {nodes} nodes of {hw.name} cannot hold one trainer group per class "
                         f"and one pool node per class")
    other = "sync" if mode == "flex" else "flex"
    # Estimates within 0.5% of each other are a tie (the model is not that exact): among them
    # prefer the plan whose nodes follow each class's compute demand (a pool sized past its
    # demand only idles: the 32B pool at 18 or 25 nodes estimates the same step), then the one
    # that also does well without overlap, then the busier one.
    plans.sort(key=lambda p: (math.floor(math.log(p.step_s[mode]) / math.log(1.005)),
                              round(p.mismatch, 3), p.step_s[other], -p.utilization[mode]))
    return plans[:top]


def describe(plan: Allocation, hw: HardwareProfile) -> str:
    """One line per class: pool and groups, then the step estimates."""
    lines = []
    for name, a in plan.allocs:
        replicas = a.pool_nodes * hw.devices_per_node // a.gpus_per_replica
        ph = plan.phases[name]
        lines.append(f"  {name}: pool {a.pool_nodes} nodes = {replicas} replicas x {a.gpus_per_replica} dev; "
                     f"{a.groups} group(s) x {a.group_nodes} nodes (TP {a.trainer_tp}); rollout "
                     f"{ph['rollout']:.1f} s, train {ph['train']:.1f} s, sync {ph['sync']:.2f} s")
    lines.append(f"  step: flex {plan.step_s['flex']:.1f} s (util {plan.utilization['flex']:.2f}), "
                 f"sync {plan.step_s['sync']:.1f} s (util {plan.utilization['sync']:.2f})")
    lines.append("  demand vs nodes: " + ", ".join(f"{name} {d:.0%} of the compute, {n:.0%} of the nodes"
                                                   for name, (d, n) in plan.shares().items())
                 + f" (mismatch {plan.mismatch:.2f})")
    return "\n".join(lines)


def config_fragment(plan: Allocation, hw: HardwareProfile, classes: list[AgentClass]) -> dict:
    """`rollout.pools` and `trainer.named_groups` of the plan in the config's own terms (one
    rank per device; agents named `<class>_<i>`; groups of a class that swap share the swap
    label `<class>`); the caller writes it as YAML."""
    counts = {c.name: c.count for c in classes}
    pools, groups = [], []
    for name, a in plan.allocs:
        agents = [f"{name}_{i}" for i in range(counts[name])]
        pools.append({"name": name, "replicas": a.pool_nodes * hw.devices_per_node // a.gpus_per_replica,
                      "gpus_per_replica": a.gpus_per_replica, "agents": agents})
        for j in range(a.groups):
            group = {"name": f"{name}_g{j}", "agents": agents[j::a.groups],
                     "ranks": a.group_nodes * hw.devices_per_node, "tensor_parallel": a.trainer_tp,
                     "backend": "megatron"}
            if a.groups < counts[name]:
                group["swap"] = name
            groups.append(group)
    return {"rollout": {"pools": pools}, "trainer": {"named_groups": groups}}


def parse_classes(text: str) -> list[AgentClass]:
    """`32b:3,14b:7` -> the Qwen2.5 presets with their agent counts."""
    from flexmarl_hpc.sim.costs import PRESETS
    out = []
    for part in filter(None, text.split(",")):
        size, _, count = part.partition(":")
        key = f"qwen2.5-{size.strip().lower()}"
        if key not in PRESETS or not count.strip().isdigit() or int(count) < 1:
            raise ValueError(f"--classes: expected SIZE:COUNT with SIZE in "
                             f"{sorted(k.split('-')[1] for k in PRESETS)}, got {part!r}")
        out.append(AgentClass(size.strip().lower(), PRESETS[key], int(count)))
    return out


def main(argv: list[str] | None = None) -> int:
    """python -m flexmarl_hpc.sim.plan --hardware npu64_a3 --nodes 48 --classes 32b:3,14b:7"""
    import argparse
    import json

    from flexmarl_hpc.sim.hardware import HardwareError, load_hardware
    ap = argparse.ArgumentParser(prog="python -m flexmarl_hpc.sim.plan", description=main.__doc__)
    ap.add_argument("--hardware", default="npu64_a3", help="profile name or YAML path")
    ap.add_argument("--nodes", type=int, default=48)
    ap.add_argument("--classes", default="32b:3,14b:7", help="SIZE:COUNT,... (Qwen2.5 presets)")
    ap.add_argument("--mode", default="flex", choices=["flex", "sync"])
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--no-swap", action="store_true", help="one trainer group per agent")
    ap.add_argument("--json", action="store_true", help="print the best plan's config fragment as JSON")
    args = ap.parse_args(argv)
    try:
        hw = load_hardware(args.hardware)
        classes = parse_classes(args.classes)
        plans = rank_plans(hw, classes, Workload(), args.nodes, args.mode, args.top, swap=not args.no_swap)
    except (HardwareError, ValueError) as e:
        print(f"error: {e}")
        return 2
    for i, p in enumerate(plans, 1):
        print(f"#{i}\n{describe(p, hw)}")
    if args.json:
        print(json.dumps(config_fragment(plans[0], hw, classes), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
