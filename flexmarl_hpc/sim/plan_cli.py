"""`simulate plan`: the closed-form planner's best splits of --nodes (sim/plan.py,
sim/plan_config.py), simulated in flex mode, and the best one's config fragment.

    python -m flexmarl_hpc.simulate plan configs/paper_3x32b_7x14b.yaml --nodes 48 --top 3 --write plan48.yaml
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flexmarl_hpc.config.load import load_plan
from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.sim import runs
from flexmarl_hpc.sim.cli_options import common_options
from flexmarl_hpc.sim.hardware import HardwareError, HardwareProfile, load_hardware
from flexmarl_hpc.sim.plan import rank_plans
from flexmarl_hpc.sim.plan_config import (config_classes, describe_alloc, describe_classes, distinct, fragment,
                                          fragment_nodes, fragment_yaml, min_nodes, plan_nodes, plan_workload)
from flexmarl_hpc.sim.runs import raw_config, write_atomic, write_plan_config


def plan(config: str, nodes: int, hardware: str, top: int, steps: int, out: Path,
         overrides: list[str] = (), baseline: bool = False) -> tuple[list[dict], dict | None]:
    """Rank splits of `nodes` in closed form, then simulate the best `top` of distinct shapes
    (sim.plan_config.distinct) in flex mode: per plan its closed-form Allocation, config fragment
    and simulated result, best simulated step first; with `baseline`, also the config's own
    allocation simulated the same way (its `nodes`: every component's but the orchestrator's)."""
    resolved = load_plan(config, overrides)
    cfg = resolved.cfg
    try:
        hw = load_hardware(hardware)
    except HardwareError as e:
        raise ValueError(f"--hardware: {e}") from None
    classes = config_classes(resolved)
    least = min_nodes(hw, classes, cfg)
    if nodes < least:
        raise ValueError(f"--nodes: expected >= {least} for {len(cfg.agent_names)} agents on {hw.name} "
                         f"({cfg.slurm.orchestrator.nodes} orchestrator node, then per class one pool node "
                         f"and one trainer group), got {nodes}")
    work, n = plan_workload(cfg), plan_nodes(cfg, nodes)
    plans = distinct(rank_plans(hw, [c.cls for c in classes], work, n, "flex", top=10**9), top)
    data = raw_config(config, overrides)
    rows = []
    for i, p in enumerate(plans, 1):
        frag = fragment(p, hw, classes, cfg)
        path = write_plan_config(out / f"plan{i}" / "config.yaml", data, frag)
        rows.append({"rank": i, "plan": p, "fragment": frag,
                     "sim": runs.run_variants(str(path), ["flex"], hardware, steps, out / f"plan{i}")["flex"]})
    rows.sort(key=lambda r: r["sim"].get("step_s", float("inf")))
    if not baseline:
        return rows, None
    current = runs.run_variants(config, ["flex"], hardware, steps, out / "config", overrides)["flex"]
    return rows, {"sim": current, "nodes": sum(c.slurm.nodes for c in resolved.components[1:])}


def plan_table(rows: list[dict], hw: HardwareProfile, current: dict | None = None, wall: bool = True) -> str:
    """Closed-form and simulated flex step time and utilization per plan (best first), then
    the config's own allocation (simulated only) when given; the wall seconds each took unless
    `wall` is off (a figure that must not drift)."""
    head = (f"{'plan':5s} {'closed-form step_s':>18s} {'util':>6s} {'simulated step_s':>17s} {'util':>6s} "
            f"{'nodes':>5s}" + (f" {'wall_s':>7s}" if wall else ""))
    lines = [head]
    for r in rows:
        p, sim = r["plan"], r["sim"]
        simulated = (f"{sim['step_s']:17.1f} {sim['util']:6.1%}" if "step_s" in sim
                     else f"{'failed':>17s} {'-':>6s}")
        lines.append(f"#{r['rank']:<4d} {p.step_s['flex']:18.1f} {p.utilization['flex']:6.1%} {simulated} "
                     f"{fragment_nodes(r['fragment']):5d}" + (f" {sim['wall_s']:7.1f}" if wall else ""))
        lines += [f"      {line}" for line in describe_alloc(p, hw)]
        if "error" in sim:
            lines.append(f"      failed: {sim['error']}")
    if current is not None:
        sim = current["sim"]
        simulated = (f"{sim['step_s']:17.1f} {sim['util']:6.1%}" if "step_s" in sim
                     else f"{'failed':>17s} {'-':>6s}")
        lines.append(f"{'config':6s}{'-':>18s} {'-':>6s} {simulated} {current['nodes']:5d}"
                     + (f" {sim['wall_s']:7.1f}" if wall else ""))
        lines.append("      the config's own pools and groups")
    return "\n".join(lines)


def plan_main(a: argparse.Namespace, out: Path) -> int:
    """`simulate plan`: runs plan(), prints, writes --write."""
    try:
        rows, current = plan(a.config, a.nodes, a.hardware, a.top, a.steps, out, a.overrides, a.baseline)
        hw = load_hardware(a.hardware)
    except (ConfigError, HardwareError, ValueError) as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    best = rows[0]
    if "step_s" not in best["sim"]:
        print(plan_table(rows, hw, current))
        print("simulate: every simulated plan failed", file=sys.stderr)
        return 1
    text = best_fragment(a.config, a.nodes, a.steps, hw, best)
    if a.write is not None:
        write_atomic(a.write, text)
    if a.json:
        print(json.dumps({"config": a.config, "hardware": hw.name, "nodes": a.nodes, "steps": a.steps,
                          "plans": [{"rank": r["rank"], "closed_form_step_s": r["plan"].step_s["flex"],
                                     "closed_form_util": r["plan"].utilization["flex"], "simulated": r["sim"],
                                     "fragment": r["fragment"]} for r in rows],
                          "config_allocation": current}, indent=1))
        return 0
    print(plan_report(a.config, a.overrides, a.nodes, a.steps, hw, rows, current, a.write), end="")
    return 0


def best_fragment(config: str, nodes: int, steps: int, hw: HardwareProfile, best: dict) -> str:
    """The best plan's rollout.pools / trainer.named_groups as YAML, under a comment saying
    what was predicted for it."""
    header = [f"simulate --plan: {config}, {nodes} nodes of {hw.name} ({fragment_nodes(best['fragment'])} "
              f"for pools and groups + the orchestrator's), plan #{best['rank']} of the closed form",
              f"predicted flex step {best['sim']['step_s']:.1f} s simulated ({steps} steps), "
              f"{best['plan'].step_s['flex']:.1f} s closed form; utilization {best['sim']['util']:.1%}"]
    return fragment_yaml(best["fragment"], header)


def plan_report(config: str, overrides: list[str], nodes: int, steps: int, hw: HardwareProfile, rows: list[dict],
                current: dict | None, written: Path | None = None, wall: bool = True) -> str:
    """What `simulate plan` prints: the classes, the plans' table, the best plan's fragment."""
    classes = describe_classes(config_classes(load_plan(config, overrides)))
    best = rows[0]
    return "\n".join([
        f"{config} on {hw.name}, {nodes} nodes; agent classes {classes}",
        f"the closed form's best {len(rows)} plans of distinct shapes, simulated (flex, {steps} steps), "
        f"best simulated first:",
        plan_table(rows, hw, current, wall),
        f"\nbest: plan #{best['rank']}; paste into the config{f' (written to {written})' if written else ''}:",
        best_fragment(config, nodes, steps, hw, best)])


def check_plan(a: argparse.Namespace) -> str | None:
    if a.nodes is None:
        return "--nodes: required (the nodes to split, orchestrator included)"
    if a.top < 1:
        return f"--top: expected >= 1, got {a.top}"
    if a.write is not None and not a.write.parent.is_dir():
        return f"--write: folder {a.write.parent} does not exist"
    return None


def plan_options(p: argparse.ArgumentParser) -> None:
    common_options(p, "npu64_a3", 4)
    p.add_argument("--nodes", type=int, default=None, help="nodes to split (orchestrator included); required")
    p.add_argument("--top", type=int, default=3, help="closed-form plans to simulate (default 3)")
    p.add_argument("--baseline", action="store_true", help="also simulate the config's own allocation")
    p.add_argument("--write", type=Path, default=None, help="write the best plan's YAML here")

