"""sync vs flex (and ablations) on the same workloads, in one invocation.

    .venv/bin/python bench/bench_modes.py                       # both workloads, all variants
    .venv/bin/python bench/bench_modes.py --workloads skewed --steps-scale 2

For each workload it runs `python -m flexmarl_hpc.run` once per variant (same seed and
config otherwise) and reads the run's HDF5 file:
  step time      median of the gaps between consecutive global steps (/metrics t)
  samples/s      samples trained per second over the same window
  utilization    busy time of the worker ranks / (worker ranks x window), from /intervals
                 (busy = generate, train, sync, swap; the orchestrator is not a worker)
Variants: sync (barrier baseline), flex, flex without level-1 load balancing, flex
without micro-batch overlap, flex with 2 over-provisioned inputs per step (samples/s
counts trained samples: dropped generations are overhead). Ratios are against sync. On a
machine with C cores the ideal speedup is bounded by C / (sync's busy cores): that bound
is printed too.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {
    "referential": ("configs/local.yaml", ["run.steps=150", "rollout.replicas=2", "rollout.max_batch=32"]),
    "skewed": ("configs/skewed.yaml", ["run.steps=12"]),
}
VARIANTS = {
    "sync": ["run.mode=sync"],
    "flex": ["run.mode=flex"],
    "flex-noLB": ["run.mode=flex", "pipeline.load_balance=false"],
    "flex-nooverlap": ["run.mode=flex", "pipeline.micro_batch_overlap=false"],
    "flex-overprov": ["run.mode=flex", "pipeline.overprovision=2"],
}


def measure(h5: Path, skip: int = 2) -> dict:
    with h5py.File(h5, "r") as f:
        t = f["metrics/t"][:]
        samples = f["metrics/samples"][:]
        ranks, roles = f["intervals/rank"][:], f["intervals/role"][:]
        act, t0, t1 = f["intervals/activity"][:], f["intervals/t0"][:], f["intervals/t1"][:]
        workers = int(f.attrs["world_size"]) - 1
    lo, hi = t[skip - 1], t[-1]                  # skip start-up (first syncs, imports)
    busy = (act != b"wait") & (roles != b"orchestrator")
    overlap = np.clip(np.minimum(t1, hi) - np.maximum(t0, lo), 0, None)
    util = overlap[busy].sum() / (workers * (hi - lo))
    return {"step_s": float(np.median(np.diff(t[skip - 1:]))),
            "samples_per_s": float(samples[skip:].sum() / (hi - lo)),
            "util": float(util), "busy_cores": float(util * workers)}


def run(config: str, overrides: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "flexmarl_hpc.run", config, f"run.output_dir={out}",
           "run.log_every=1000", *overrides]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return measure(next(out.glob("*.h5")))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    a = ap.parse_args()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        for wl in a.workloads:
            config, base = WORKLOADS[wl]
            res = {v: run(config, base + VARIANTS[v], Path(tmp) / f"{wl}-{v}") for v in a.variants}
            print(f"\n== {wl} ({config} {' '.join(base)}), {cores} cores")
            print(f"{'variant':16s} {'step s':>8s} {'samples/s':>10s} {'util':>6s} {'speedup':>8s} {'x samples/s':>12s} {'x util':>7s}")
            ref = res.get("sync")
            for v, r in res.items():
                sp = ref["step_s"] / r["step_s"] if ref else float("nan")
                xs = r["samples_per_s"] / ref["samples_per_s"] if ref else float("nan")
                xu = r["util"] / ref["util"] if ref else float("nan")
                print(f"{v:16s} {r['step_s']:8.3f} {r['samples_per_s']:10.1f} {r['util']:6.1%} "
                      f"{sp:8.2f} {xs:12.2f} {xu:7.2f}")
            if ref:
                bound = cores / max(ref["busy_cores"], 1e-9)
                print(f"ideal speedup bound on {cores} cores: {bound:.2f} "
                      f"(sync keeps {ref['busy_cores']:.2f} cores busy)")
                if "flex" in res:
                    got = ref["step_s"] / res["flex"]["step_s"]
                    print(f"flex reaches {got:.2f}x of that {bound:.2f}x bound ({got / bound:.0%})")


if __name__ == "__main__":
    main()
