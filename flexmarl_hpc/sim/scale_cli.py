"""`simulate scale`: per accelerator count the planner's best split for each variant's
mode, simulated (sim/scale.py is its pure side: the sizes, the points, the figure).

    python -m flexmarl_hpc.simulate scale configs/paper_3x32b_7x14b.yaml --counts 128,512,3072 --png scale.png
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from flexmarl_hpc.config.load import load_plan
from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.sim import runs
from flexmarl_hpc.sim.cli_options import common_options, variants_option
from flexmarl_hpc.sim.hardware import HardwareError, load_hardware
from flexmarl_hpc.sim.plan_config import config_classes, describe_alloc, fragment, plan_workload
from flexmarl_hpc.sim.runs import raw_config, variant_list, variant_mode, write_plan_config
from flexmarl_hpc.sim.scale import bottleneck_table, parse_sizes, plot_scale, scale_points


def scale(config: str, sizes: list[int], variants: list[str], hardware: str, steps: int, out: Path,
          overrides: list[str] = (), progress=lambda line: None) -> list[dict]:
    """Per accelerator count (sim.scale.scale_points): the closed-form planner's best split for
    each variant's mode, pasted into a copy of the config (as --plan does) and simulated;
    a row per count with its nodes, allocation and per-variant result, or why it does not fit."""
    plan = load_plan(config, overrides)
    cfg = plan.cfg
    try:
        hw = load_hardware(hardware)
    except HardwareError as e:
        raise ValueError(f"--hardware: {e}") from None
    classes, data = config_classes(plan), raw_config(config, overrides)
    modes = tuple(dict.fromkeys(variant_mode(v) for v in variants))
    rows = []
    for pt in scale_points(sizes, hw, classes, plan_workload(cfg), cfg, modes):
        row = {"devices": pt.devices, "nodes": pt.nodes, "devices_used": pt.devices_used,
               "hardware": pt.hw.name, "reason": pt.reason}
        rows.append(row)
        if not pt.fits:
            progress(f"{pt.devices} accelerators: {pt.reason}")
            continue
        row["allocation"] = {m: describe_alloc(p, pt.hw) for m, p in pt.plans.items()}
        row["closed_form_step_s"] = {m: p.step_s[m] for m, p in pt.plans.items()}
        res = {}
        for m in modes:
            path = write_plan_config(out / str(pt.devices) / m / "config.yaml", data,
                                     fragment(pt.plans[m], pt.hw, classes, cfg))
            mine = [v for v in variants if variant_mode(v) == m]
            res.update(runs.run_variants(str(path), mine, pt.hw, steps, path.parent))
        row["variants"] = {v: res[v] for v in variants}
        sync = res.get("sync", {}).get("step_s")
        for r in row["variants"].values():
            if sync and "step_s" in r:
                r["speedup_vs_sync"] = sync / r["step_s"]
        progress(f"{pt.devices} accelerators ({pt.nodes} nodes): " + ", ".join(
            f"{v} {r['step_s']:.1f} s" if "step_s" in r else f"{v} failed" for v, r in row["variants"].items())
            + f" (wall {sum(r['wall_s'] for r in res.values()):.1f} s)")
    return rows


def scale_table(rows: list[dict], variants: list[str]) -> str:
    """Accelerators, nodes, then per variant step_s and utilization (or why it does not fit)."""
    lines = [f"{'accel':>6s} {'nodes':>5s} " + " ".join(f"{v:>19s}" for v in variants),
             f"{'':12s}" + " ".join(f"{'step_s   util':>19s}" for _ in variants)]
    for r in rows:
        head = f"{r['devices_used']:6d} {r['nodes']:5d} "
        if r["reason"]:
            lines.append(f"{r['devices']:6d} {r['nodes']:5d} {r['reason']}")
            continue
        cells = []
        for v in variants:
            x = r["variants"][v]
            cells.append(f"{x['step_s']:11.1f} {x['util']:6.1%}" if "step_s" in x else f"{'failed':>18s}")
        lines.append(head + " ".join(f"{c:>19s}" for c in cells))
    return "\n".join(lines)


def scale_main(a: argparse.Namespace, out: Path) -> int:
    """`simulate scale`: runs scale(), prints, writes --png."""
    sizes, variants = parse_sizes(a.counts), variant_list(a.variants)
    wall = time.perf_counter()
    try:
        rows = scale(a.config, sizes, variants, a.hardware, a.steps, out, a.overrides,
                     progress=lambda line: print(f"scale: {line}", file=sys.stderr, flush=True))
    except (ConfigError, HardwareError, ValueError) as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - wall
    fitting = [r for r in rows if not r["reason"]]
    if a.png is not None and fitting:
        plot_scale(rows, variants, a.png, f"{Path(a.config).name} on {a.hardware}: simulated, "
                                           f"{a.steps} steps, closed-form planner's allocation per size")
    if a.json:
        print(json.dumps({"config": a.config, "hardware": a.hardware, "steps": a.steps, "wall_s": wall,
                          "sizes": rows}, indent=1))
    else:
        print(f"{a.config} on {a.hardware}, {a.steps} steps (simulated) per accelerator count; wall {wall:.1f} s")
        print(scale_table(rows, variants))
        print(bottleneck_table(rows, variants))
        if a.png is not None and fitting:
            print(f"wrote {a.png}")
    if not fitting:
        print("simulate: scale: no accelerator count fits the config's models", file=sys.stderr)
        return 1
    return 1 if any("error" in x for r in fitting for x in r["variants"].values()) else 0


def check_scale(a: argparse.Namespace) -> str | None:
    try:
        parse_sizes(a.counts, "--counts")
    except ValueError as e:
        return str(e)
    if a.png is not None and (a.png.suffix.lower() != ".png" or not a.png.parent.is_dir()):
        return f"--png: expected a .png path in an existing folder, got {a.png}"
    return None


def scale_options(p: argparse.ArgumentParser) -> None:
    common_options(p, "npu64_a3", 4)
    p.add_argument("--counts", required=True, help="accelerator counts, e.g. 1,2,4,...,3072")
    variants_option(p)
    p.add_argument("--png", type=Path, default=None, help="write the step time / utilization curve here")

