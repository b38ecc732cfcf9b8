"""`simulate paper`: the shell of sim/paper.py (options, printing, the parameters file).

    python -m flexmarl_hpc.simulate paper [--json]                 # paper vs simulator, MA and CA
    python -m flexmarl_hpc.simulate paper --fit                    # fit on MA, write the parameters file
    python -m flexmarl_hpc.simulate paper --sweep                  # which unknown moves which ratio
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from flexmarl_hpc.sim.hardware import HARDWARE_DIR, load_hardware, save_hardware
from flexmarl_hpc.sim.paper import (FIT_FIELDS, SEEDS, SPEC_FIELDS, fit_ma, fit_table, paper_rows, summarize, sweep,
                                    sweep_table, table)
from flexmarl_hpc.sim.workload import TASKS

PARAMS = HARDWARE_DIR / "npu64_a3_paper.yaml"
"""The parameters file `--fit` writes and the table reads (npu64_a3 with fitted efficiencies)."""


def paper_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="per task the five step times and busy, as JSON")
    p.add_argument("--fit", action="store_true", help="fit the efficiencies on MA, write --write, print both tasks")
    p.add_argument("--sweep", action="store_true", help="vary each unknown of the MA spec, print the ratios")
    p.add_argument("--write", type=Path, default=PARAMS, help=f"--fit's parameters file (default {PARAMS.name})")
    p.add_argument("--params", type=Path, default=None,
                   help=f"the profile to simulate on (default {PARAMS.name} if it exists, else npu64_a3)")
    p.add_argument("--steps", type=int, default=8, help="simulated steps per system (the first is not timed)")
    p.add_argument("--seeds", type=int, default=SEEDS,
                   help=f"workload seeds 0..N-1 every figure is taken over (mean [min, max]; default {SEEDS})")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for the simulated runs (given: the table's runs are kept; --fit and --sweep "
                        "delete each run's files once measured)")
    p.add_argument("--jobs", type=int, default=2, help="runs (--fit: grid points) simulated at once, one process each")


def check_paper(a: argparse.Namespace) -> str | None:
    if a.fit and a.sweep:
        return "--fit and --sweep: give one of them"
    if a.jobs < 1:
        return f"--jobs: expected >= 1, got {a.jobs}"
    if a.seeds < 1:
        return f"--seeds: expected >= 1, got {a.seeds}"
    if a.steps < 2:
        return f"--steps: expected >= 2 (the first is not timed), got {a.steps}"
    return None


def paper_main(a: argparse.Namespace, out: Path) -> int:
    wall = time.perf_counter()
    fields = None
    if a.fit:
        fitted, fields, points = fit_ma(load_hardware("npu64_a3"), a.steps, out, log=lambda s: None, jobs=a.jobs,
                                        seeds=a.seeds)
        best = {f: getattr(fitted.efficiency, f) for f in FIT_FIELDS}
        spec = ", ".join(f"{k} {v}" for k, v in fields.items())
        save_hardware(fitted, a.write, header=f"npu64_a3 with {', '.join(FIT_FIELDS)} fitted on the paper's MA task\n"
                      f"by `python -m flexmarl_hpc.simulate paper --fit` ({a.steps} steps): {best}, "
                      f"with {spec} (sim/workload.py TaskSpec)")
        print(f"fit on MA over {', '.join(FIT_FIELDS + SPEC_FIELDS)}: best {best}, {spec}; every point "
              "(loss: squared log errors of flex's step, the four ratios and busy):")
        print(fit_table(points))
        print(f"wrote {a.write}; TaskSpec's (the table's): "
              + ", ".join(f"{n} {getattr(TASKS['MA'], n)}" for n in SPEC_FIELDS))
        hw, fitted_on = fitted, "MA"
    else:
        path = a.params or (PARAMS if PARAMS.exists() else Path("npu64_a3"))
        hw, fitted_on = load_hardware(path), ("MA" if Path(path).resolve() == PARAMS.resolve() else None)
    if a.sweep:
        print(sweep_table(sweep(hw, a.steps, out, seeds=a.seeds)))
        return 0
    rows = paper_rows(hw, a.steps, out, spec_fields=fields, seeds=a.seeds, jobs=a.jobs, keep=a.out is not None)
    if a.json:
        print(json.dumps({**{t: summarize(runs) for t, runs in rows.items()}, "hardware": hw.name, "steps": a.steps,
                          "seed_ids": list(range(a.seeds)), "wall_s": time.perf_counter() - wall}, indent=1))
    else:
        print(table(rows, fitted_on))
        print(f"(on {hw.name}, {a.steps} steps per system, seeds 0-{a.seeds - 1}; "
              f"wall {time.perf_counter() - wall:.0f} s with --jobs {a.jobs})")
    return 0
