"""Simulate a config at cluster scale: the real orchestrator on a discrete-event clock.

    python -m flexmarl_hpc.simulate configs/paper_3x32b_7x14b.yaml --compare sync,flex
    python -m flexmarl_hpc.simulate configs/paper_5x32b.yaml --hardware h100_ndr --steps 10 --json
    python -m flexmarl_hpc.simulate configs/local.yaml --capacity          # the orchestrator's own limit

Each variant of --compare runs the real Orchestrator, Scheduler, Experience, workflow and
rewards over sim.transport.SimTransport with synthetic workers priced by sim.costs (see
sim/driver.py for what is modelled and README "Scale"). Each writes
`<out>/<variant>/<run>.h5` (the run schema, attrs simulated=True and hardware), which
`python -m flexmarl_hpc.analyze` reads unchanged. Printed per variant: step_s (median gap
between global steps after the first 2), accelerator utilization, samples/s and the ratio of
sync's step time to the variant's.

--capacity runs flex with zero-cost workers and the orchestrator's real compute charged to
the clock: samples/s is then what the single orchestrator rank can drive on this CPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from .config import ConfigError, load_config
from .sim.driver import Workload, cost_model, measure, rank_devices, simulate_run
from .sim.hardware import HardwareError, load_hardware
from .sim.transport import ConstantCost

VARIANTS = {
    "sync": ["run.mode=sync"],
    "flex-nopipe": ["run.mode=flex", "pipeline.micro_batch_overlap=false"],
    "flex-nolb": ["run.mode=flex", "pipeline.load_balance=false"],
    "flex": ["run.mode=flex"],
    "flex-stale1": ["run.mode=flex", "pipeline.max_staleness=1"],
}
"""Variant -> config overrides (as bench/bench_modes.py expresses the ablations)."""


def run_variants(config: str, variants: list[str], hardware: str, steps: int, out: Path,
                 overrides: list[str] = ()) -> dict[str, dict]:
    hw = load_hardware(hardware)
    results = {}
    for v in variants:
        cfg = load_config(config, [*overrides, *VARIANTS[v], f"run.steps={steps}", "run.resume=false",
                                   f"run.output_dir={out / v}", "run.checkpoint_every=0",
                                   "run.checkpoint_minutes=0"])
        wall = time.perf_counter()
        try:
            path, sim = simulate_run(cfg, cost_model(cfg, hw), out / v, hw.name, Workload())
        except RuntimeError as e:      # e.g. the orchestrator waits with nothing in flight
            results[v] = {"error": str(e), "wall_s": time.perf_counter() - wall}
            continue
        r = measure(path, rank_devices(cfg))
        r.update(wall_s=time.perf_counter() - wall, sim_s=sim.now - sim_t0(path), h5=str(path))
        results[v] = r
    if "step_s" in results.get("sync", {}):
        for r in results.values():
            if "step_s" in r:
                r["speedup_vs_sync"] = results["sync"]["step_s"] / r["step_s"]
    return results


def sim_t0(path: Path) -> float:
    import h5py
    with h5py.File(path, "r") as f:
        return float(f.attrs["t0"])


def capacity(config: str, steps: int, out: Path, overrides: list[str] = ()) -> dict:
    """Zero-cost workers, the orchestrator's real compute on the clock: samples/s it drives."""
    cfg = load_config(config, [*overrides, "run.mode=flex", f"run.steps={steps}", "run.resume=false",
                               f"run.output_dir={out}", "run.checkpoint_every=0", "run.checkpoint_minutes=0"])
    wall = time.perf_counter()
    path, sim = simulate_run(cfg, ConstantCost(), out, "zero-cost", charge_orchestrator=True)
    wall = time.perf_counter() - wall
    r = measure(path, rank_devices(cfg), skip=1)
    return {"samples_per_s": r["samples_per_s"], "step_s": r["step_s"], "wall_s": wall,
            "commands": sim.sent, "commands_per_s": sim.sent / max(sim.now - sim_t0(path), 1e-9)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flexmarl_hpc.simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p.add_argument("--hardware", default="npu64_a3", help="configs/hardware/<name>.yaml or a path")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compare", default="sync,flex", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--out", type=Path, default=None, help="folder of the variants' HDF5 files (default: a temp dir)")
    p.add_argument("--capacity", action="store_true", help="measure the orchestrator's own samples/s")
    a = p.parse_args(argv)
    variants = [v.strip() for v in a.compare.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        print(f"--compare: unknown variant(s) {bad}; expected some of {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if a.steps < 3:
        print(f"--steps: expected >= 3 (the first 2 steps are start-up), got {a.steps}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = a.out or Path(tmp)
        try:
            if a.capacity:
                res = capacity(a.config, a.steps, out / "capacity", a.overrides)
                print(json.dumps(res, indent=1) if a.json else
                      f"orchestrator capacity: {res['samples_per_s']:.0f} samples/s, "
                      f"{res['commands_per_s']:.0f} commands/s ({res['commands']} commands, wall {res['wall_s']:.1f} s)")
                return 0
            res = run_variants(a.config, variants, a.hardware, a.steps, out, a.overrides)
            failed = any("error" in r for r in res.values())
        except (ConfigError, HardwareError, ValueError) as e:
            print(f"simulate: {e}", file=sys.stderr)
            return 2
        if a.json:
            print(json.dumps({"config": a.config, "hardware": a.hardware, "steps": a.steps,
                              "variants": res}, indent=1))
        else:
            print(f"{a.config} on {a.hardware}, {a.steps} steps (simulated)")
            print(f"{'variant':12s} {'step_s':>9s} {'util':>6s} {'samples/s':>10s} {'vs sync':>8s} {'wall_s':>7s}")
            for v, r in res.items():
                if "error" in r:
                    print(f"{v:12s} failed: {r['error']}")
                    continue
                ratio = f"{r['speedup_vs_sync']:.2f}x" if "speedup_vs_sync" in r else "-"
                print(f"{v:12s} {r['step_s']:9.1f} {r['util']:6.1%} {r['samples_per_s']:10.2f} "
                      f"{ratio:>8s} {r['wall_s']:7.1f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
