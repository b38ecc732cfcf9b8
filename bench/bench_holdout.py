"""A pre-registered hold-out of the CPU simulator (issue 37): a configuration neither the
profile's fit nor the calibration test ever saw, predicted before it is run.

    .venv/bin/python bench/bench_holdout.py calibrate --write PROFILE   # one real sync run of A, fit, write
    .venv/bin/python bench/bench_holdout.py predict --profile PROFILE   # the prediction, 5 workload seeds
    .venv/bin/python bench/bench_holdout.py measure --profile PROFILE --reps 3   # real runs vs prediction

A (the calibration, as tests/e2e/test_calibrate_e2e.py): bench_modes' referential game, sync.
HOLDOUT: configs/relay3.yaml (3 agents in a chain) with ONE trainer group for its 3 agents
(trainer.groups=1, pipeline.swap_states=true: states swapped in and out), 2 replicas, 4 ranks;
variants sync, flex, flex-nolb. No fit or test has run a shared trainer group on the CPU.

Why a script: the judging rule is fixed with the prediction, in the same commit. `measure`
runs the variants interleaved (rotated each repetition), samples each run's machine load over
its timed steps (sim.hostload.LoadSampler), and predicts each run at that load with the committed
profile (the only input taken from the measurement; the profile is not refitted). Errors are
predicted / measured - 1 of the per-variant median over repetitions, and per effect
(r - 1, r = variant's step / flex's, paired by repetition).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flexmarl_hpc.sim.calibrate_cli import calibrate, predict_variants, with_load  # noqa: E402
from flexmarl_hpc.sim.driver import measure  # noqa: E402
from flexmarl_hpc.sim.hardware import load_hardware, save_hardware  # noqa: E402
from flexmarl_hpc.sim.hostload import LoadSampler  # noqa: E402

COMMON = ["run.log_every=1000", "run.checkpoint_every=0", "run.checkpoint_minutes=0", "run.resume=false",
          "run.eval_every=0", "run.steps=12"]
A = ("configs/local.yaml", ["rollout.replicas=2", "rollout.max_batch=32", "workflow.task_args.num_objects=8",
                            "workflow.inputs_per_step=8"])
HOLDOUT = ("configs/relay3.yaml", ["trainer.groups=1", "pipeline.swap_states=true"])
VARIANTS = ("sync", "flex", "flex-nolb")
MODE = {"sync": ["run.mode=sync"], "flex": ["run.mode=flex"],
        "flex-nolb": ["run.mode=flex", "pipeline.load_balance=false"]}
STEPS = 12
SKIP = 2
"""Start-up steps left out of the timed window (driver.measure's skip)."""
LOADS = (0.0, 0.5, 1.0, 1.5)
"""External loads (cores busy with other processes) the prediction is tabled at."""
SEEDS = 5
LOAD_BIN = 0.1


def real_run(workload: tuple, variant: str, out: Path) -> dict:
    """One real MPI run; its step time (mean over the timed steps) and the external load then."""
    config, over = workload
    cmd = [sys.executable, "-m", "flexmarl_hpc.run", config, f"run.output_dir={out}", *over, *COMMON, *MODE[variant]]
    with LoadSampler() as sampler:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    path = next(out.glob("*.h5"))
    with h5py.File(path, "r") as f:
        t = f["metrics"]["t"][:] + float(f.attrs["t0"])
    t = t[SKIP - 1:]
    load = sampler.window(float(t[0]), float(t[-1]))
    return {"variant": variant, "path": path, "step_s": float((t[-1] - t[0]) / (len(t) - 1)), "load": load}


def external(hw, load) -> float:
    return hw.efficiency.shared_cores - load.available(hw.efficiency.shared_cores)


def predict(hw, variant: str, ext: float, seed: int, out: Path) -> float:
    config, over = HOLDOUT
    loaded = with_load(hw, round(ext / LOAD_BIN) * LOAD_BIN)
    return predict_variants(config, [variant], loaded, STEPS, out, [*over, "run.eval_every=0", f"run.seed={seed}"],
                            "synthetic")[variant]["step_s"]


def span(xs) -> str:
    return f"{np.mean(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]"


def cmd_calibrate(a, tmp: Path) -> None:
    r = real_run(A, "sync", tmp / "A")
    hw = load_hardware("cpu_local")
    ext = external(hw, r["load"])
    fitted = calibrate(str(r["path"]), external_cores=ext)
    save_hardware(fitted, a.write, header=f"cpu_local fitted by bench/bench_holdout.py calibrate on one sync run of "
                  f"bench_modes' referential game ({STEPS} steps, step {r['step_s']:.3f} s at external load "
                  f"{ext:.2f} cores; the fit removes it)")
    print(f"A sync: step {r['step_s']:.3f} s, external load {ext:.2f} cores; wrote {a.write}")


def cmd_predict(a, tmp: Path) -> None:
    hw = load_hardware(a.profile)
    print(f"{HOLDOUT[0]} {' '.join(HOLDOUT[1])}, {STEPS} steps, on {a.profile}: step s, mean [min, max] "
          f"over workload seeds 0-{SEEDS - 1}")
    for ext in LOADS:
        steps = {v: [predict(hw, v, ext, k, tmp / f"p{ext}_{k}") for k in range(SEEDS)] for v in VARIANTS}
        eff = {v: [s / f - 1 for s, f in zip(steps[v], steps["flex"])] for v in ("sync", "flex-nolb")}
        print(f"external {ext:.1f} cores: " + "  ".join(f"{v} {span(steps[v])}" for v in VARIANTS)
              + "  effects r - 1: " + "  ".join(f"{v}/flex {span(eff[v])}" for v in eff))


def cmd_measure(a, tmp: Path) -> None:
    hw = load_hardware(a.profile)
    runs = []
    for rep in range(a.reps):
        order = VARIANTS[rep % 3:] + VARIANTS[:rep % 3]
        for v in order:
            r = real_run(HOLDOUT, v, tmp / f"{v}{rep}")
            r["rep"], r["ext"] = rep, external(hw, r["load"])
            r["pred"] = predict(hw, v, r["ext"], 0, tmp / f"pred{v}{rep}")
            print(f"rep {rep} {v:9s}: measured {r['step_s']:.3f} s, predicted {r['pred']:.3f} s at external "
                  f"{r['ext']:.2f} cores (load avg {r['load'].loadavg:.1f})", flush=True)
            runs.append(r)
    by = {v: sorted((r for r in runs if r["variant"] == v), key=lambda r: r["rep"]) for v in VARIANTS}
    print(f"\n{a.reps} interleaved repetitions: median [min, max]")
    for v in VARIANTS:
        m, p = [r["step_s"] for r in by[v]], [r["pred"] for r in by[v]]
        print(f"{v:9s} measured {statistics.median(m):.3f} [{min(m):.3f}, {max(m):.3f}]  predicted "
              f"{statistics.median(p):.3f}  error {statistics.median(p) / statistics.median(m) - 1:+.1%}")
    for v in ("sync", "flex-nolb"):
        m = [r["step_s"] / f["step_s"] - 1 for r, f in zip(by[v], by["flex"])]
        p = [r["pred"] / f["pred"] - 1 for r, f in zip(by[v], by["flex"])]
        mm, pm = statistics.median(m), statistics.median(p)
        print(f"effect {v}/flex - 1: measured {mm:+.3f} [{min(m):+.3f}, {max(m):+.3f}]  predicted {pm:+.3f}  "
              f"difference {pm - mm:+.3f}" + (f"  relative {pm / mm - 1:+.0%}" if abs(mm) > 1e-9 else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("calibrate").add_argument("--write", type=Path, required=True)
    sub.add_parser("predict").add_argument("--profile", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--profile", required=True)
    m.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="holdout_") as tmp:
        {"calibrate": cmd_calibrate, "predict": cmd_predict, "measure": cmd_measure}[a.cmd](a, Path(tmp))


if __name__ == "__main__":
    main()
