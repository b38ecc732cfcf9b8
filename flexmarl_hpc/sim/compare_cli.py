"""`simulate compare`: the variants of one config simulated side by side (sim/runs.py), with
jitter, stragglers and a node failure on request.

    python -m flexmarl_hpc.simulate compare configs/paper_3x32b_7x14b.yaml --variants sync,flex
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.sim.cli_options import common_options, variants_option, workers_option
from flexmarl_hpc.sim.driver import cost_model
from flexmarl_hpc.sim.hardware import HardwareError, load_hardware
from flexmarl_hpc.sim.perturb import Failure, Perturbation, checkpoint_load_s, with_failure
from flexmarl_hpc.sim.runs import run_config, run_variants, variant_list


def _secs(x: float) -> str:
    """Seconds with 4 significant digits: 1520.3 s on a paper config, 0.1187 on a CPU one."""
    return f"{x:.1f}" if x >= 1000 else f"{x:.4g}"


def compare_table(config: str, hardware: str, steps: int, res: dict[str, dict], wall: bool = True) -> str:
    """Per variant: step_s, utilization, samples/s, sync's step time over the variant's (and
    the wall seconds the simulation took, unless `wall` is off: a figure that must not drift)."""
    lines = [f"{config} on {hardware}, {steps} steps (simulated)",
             f"{'variant':12s} {'step_s':>9s} {'util':>6s} {'samples/s':>10s} {'vs sync':>8s}"
             + (f" {'wall_s':>7s}" if wall else "")]
    for v, r in res.items():
        if "error" in r:
            lines.append(f"{v:12s} failed: {r['error']}")
            continue
        ratio = f"{r['speedup_vs_sync']:.2f}x" if "speedup_vs_sync" in r else "-"
        lines.append(f"{v:12s} {_secs(r['step_s']):>9s} {r['util']:6.1%} {r['samples_per_s']:10.2f} "
                     f"{ratio:>8s}" + (f" {r['wall_s']:7.1f}" if wall else ""))
    return "\n".join(lines)


def seed_overrides(config: str, seed: int) -> list[str]:
    """The overrides of workload seed `seed`: the run's (each episode's draws) and, for a text
    episode (workflows/paper_text.py), the agents' length medians."""
    import yaml
    raw = yaml.safe_load(Path(config).read_text()) or {}
    episode = (raw.get("workflow") or {}).get("episode", "")
    return [f"run.seed={seed}"] + ([f"workflow.episode_args.seed={seed}"] if "paper_text" in episode else [])


def seeds_table(config: str, hardware: str, steps: int, runs: list[dict[str, dict]]) -> str:
    """Per variant over the workload seeds: step_s and sync's step over the variant's, each
    mean [min, max]."""
    span = lambda xs, f: f"{sum(xs) / len(xs):{f}} [{min(xs):{f}}, {max(xs):{f}}]"
    lines = [f"{config} on {hardware}, {steps} steps (simulated), workload seeds 0-{len(runs) - 1}: mean [min, max]",
             f"{'variant':12s} {'step_s':>22s} {'vs sync':>20s}"]
    for v in runs[0]:
        if any("error" in r[v] for r in runs):
            lines.append(f"{v:12s} failed: " + next(r[v]["error"] for r in runs if "error" in r[v]))
            continue
        ratio = (span([r[v]["speedup_vs_sync"] for r in runs], ".2f") + "x") if "speedup_vs_sync" in runs[0][v] else "-"
        lines.append(f"{v:12s} {span([r[v]['step_s'] for r in runs], '.1f'):>22s} {ratio:>20s}")
    return "\n".join(lines)


def compare_seeds(a: argparse.Namespace, out: Path) -> list[dict[str, dict]]:
    """run_variants once per workload seed 0..N-1 (each seed's runs under out/seedK)."""
    return [run_variants(a.config, variant_list(a.variants), a.hardware, a.steps, out / f"seed{k}",
                         [*a.overrides, *seed_overrides(a.config, k)], a.workers)
            for k in range(a.workload_seeds)]


def compare_main(a: argparse.Namespace, out: Path) -> int:
    """`simulate compare`: each variant simulated, a table (or JSON); exit 1 if one failed."""
    if a.workload_seeds > 1:
        try:
            runs = compare_seeds(a, out)
        except (ConfigError, HardwareError, ValueError) as e:
            print(f"simulate: {e}", file=sys.stderr)
            return 2
        print(json.dumps({"config": a.config, "hardware": a.hardware, "steps": a.steps, "seeds": runs}, indent=1)
              if a.json else seeds_table(a.config, a.hardware, a.steps, runs))
        return 1 if any("error" in r for res in runs for r in res.values()) else 0
    try:
        prob, factor = (float(x) for x in a.stragglers.split(":")) if a.stragglers else (0.0, 1.0)
        perturb = Perturbation(a.seed, a.jitter, prob, factor)
        res = run_variants(a.config, variant_list(a.variants), a.hardware, a.steps, out, a.overrides, a.workers,
                           perturb=perturb)
        if a.fail_at is not None:
            add_failure(res, a)
    except (ConfigError, HardwareError, ValueError) as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"config": a.config, "hardware": a.hardware, "steps": a.steps, "variants": res}, indent=1)
          if a.json else compare_table(a.config, a.hardware, a.steps, res))
    if a.fail_at is not None and not a.json:
        for v, r in res.items():
            if "done_with_failure_s" in r:
                print(f"{v}: {a.steps} steps done at {r['done_s']:.0f} s; with a node failure at {a.fail_at:g} s, "
                      f"at {r['done_with_failure_s']:.0f} s (+{r['failure_lost_s']:.0f} s)")
    return 1 if any("error" in r for r in res.values()) else 0


def add_failure(res: dict[str, dict], a: argparse.Namespace) -> None:
    """Each variant's time to finish its steps when a node fails at --fail-at (sim.perturb):
    the steps since the last checkpoint redone after --restart-s and the checkpoint's read."""
    import h5py
    for v, r in res.items():
        if "h5" not in r:
            continue
        with h5py.File(r["h5"], "r") as f:
            m = f["metrics"][:]
            plan = run_config(r["h5"])
        t = m[m["superseded"] == 0]["t"]                 # seconds since the run's start
        cost = cost_model(plan, load_hardware(a.hardware))
        load = checkpoint_load_s(sum(cost.state_bytes(x) for x in plan.cfg.agent_names), a.fs_gb_s)
        ends = with_failure(t, a.checkpoint_every, Failure(a.fail_at, a.restart_s, load))
        r.update(done_s=float(t[-1]), done_with_failure_s=float(ends[-1]), failure_lost_s=float(ends[-1] - t[-1]))


def check_compare(a: argparse.Namespace) -> str | None:
    if a.workload_seeds < 1:
        return f"--workload-seeds: expected >= 1, got {a.workload_seeds}"
    if a.workload_seeds > 1 and (a.jitter or a.stragglers or a.fail_at is not None):
        return "--workload-seeds: give it without --jitter, --stragglers and --fail-at"
    return None


def compare_options(p: argparse.ArgumentParser) -> None:
    common_options(p, "npu64_a3", 10)
    variants_option(p)
    workers_option(p)
    p.add_argument("--jitter", type=float, default=0.0, help="lognormal sigma of every operation's duration (mean 1)")
    p.add_argument("--stragglers", default="", metavar="PROB:FACTOR",
                   help="each operation is FACTOR times slower with probability PROB (e.g. 0.01:5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the jitter and stragglers")
    p.add_argument("--workload-seeds", type=int, default=1, metavar="N",
                   help="N > 1: every variant at workload seeds 0..N-1 (run.seed, and a text episode's "
                        "episode_args.seed), each figure mean [min, max] (no jitter, stragglers or failure)")
    p.add_argument("--fail-at", type=float, default=None, metavar="S",
                   help="a node fails S simulated seconds in: the run restarts from its last checkpoint")
    p.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints (for --fail-at)")
    p.add_argument("--restart-s", type=float, default=300.0, help="seconds from a failure to the restarted run")
    p.add_argument("--fs-gb-s", type=float, default=10.0, help="file system GB/s reading the checkpoint back")

