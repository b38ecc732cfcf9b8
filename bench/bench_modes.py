"""sync vs flex (and ablations) on the same workloads, repeated and interleaved.

    .venv/bin/python bench/bench_modes.py                       # both workloads, all variants, 3 reps
    .venv/bin/python bench/bench_modes.py --workloads skewed --reps 5
    .venv/bin/python bench/bench_modes.py --workloads skewed --variants sync flex --steps 5   # a loaded machine
    .venv/bin/python bench/bench_modes.py --workloads referential --variants sync flex --against HEAD~1
    .venv/bin/python bench/bench_modes.py --workloads math_team --variants sync flex flex-noLB

`--against REV` also runs every variant on the code of git revision REV (a temporary
worktree), interleaved with the current tree's runs, as variant `<name>@REV`: a code change
measured A/B in one invocation, with the ratio current / REV of each variant's step time.

For each workload it runs `python -m flexmarl_hpc.run` once per variant and repetition, in
the order A B C .., B C .. A, .. (rotated each repetition, so drift of a shared machine hits
every variant alike and none always runs first), with the
same seed and config otherwise, and reads each run's HDF5 file:
  step s       median gap between consecutive global steps (/metrics t), start-up skipped
  samples/s    samples trained per second over the same window
  util         busy time of the worker ranks / (worker ranks x window), from /intervals
  orch         busy fraction of the orchestrator (rank 0) over the window
  crit s       per step, the busy time of the busiest rank (orchestrator included): a rank's
               intervals never overlap, so no schedule of the same work can make a step
               shorter than that, whatever the core count
  cpu          CPU seconds of all ranks (getrusage of the children) / the run's wall time:
               the cores the run kept busy on average, start-up included
Each figure is printed as median [min, max] over the repetitions, and so is each ratio to sync
(ratios pair the runs of one repetition). `bound` = sync step time / the variant's crit s is an
upper bound on the speedup the variant's measured work allows; it holds by construction and
tells how far the run is from its busiest rank (a run far below it waits on latency, not work).
Variants: sync (barrier baseline), flex, flex without level-1 load balancing, flex without
micro-batch overlap, flex with 2 over-provisioned inputs per step (samples/s counts trained
samples: dropped generations are overhead).
"""
from __future__ import annotations

import argparse
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {
    # the referential workload the README's figures were measured on (the 8-object game the
    # default config had then; no evaluation)
    "referential": ("configs/local.yaml", ["run.steps=80", "rollout.replicas=2", "rollout.max_batch=32",
                                           "workflow.task_args.num_objects=8", "workflow.inputs_per_step=8",
                                           "run.eval_every=0"]),
    "skewed": ("configs/skewed.yaml", ["run.steps=8"]),
    # LLM text with skewed calls: SmolLM2-135M planner/solvers/verifier on word problems
    # (configs/math_team.yaml; needs scripts/setup_smollm2.sh and make_math_team_data.py),
    # two replicas for three agents, short
    "math_team": ("configs/math_team.yaml", ["run.steps=5", "workflow.inputs_per_step=2", "workflow.group_size=2",
                                             "workflow.max_new_tokens=32", "rollout.replicas=2", "rollout.max_batch=16",
                                             "run.checkpoint_every=0"]),
}
VARIANTS = {
    "sync": ["run.mode=sync"],
    "flex": ["run.mode=flex"],
    "flex-noLB": ["run.mode=flex", "pipeline.load_balance=false"],
    "flex-nooverlap": ["run.mode=flex", "pipeline.micro_batch_overlap=false"],
    "flex-overprov": ["run.mode=flex", "pipeline.overprovision=2"],
}
FIGURES = ("step_s", "samples_per_s", "util", "orch", "crit_s", "cpu")


def measure(h5: Path, skip: int = 2) -> dict:
    with h5py.File(h5, "r") as f:
        m, iv = f["metrics"][:], f["intervals"][:]            # schema 2: one compound table each
        workers = int(f.attrs["world_size"]) - 1
    m = m[m["superseded"] == 0]
    t, samples = m["t"], m["samples"]
    rank, role, act, t0, t1 = (iv[c] for c in ("rank", "role", "activity", "t0", "t1"))
    lo, hi = t[skip - 1], t[-1]                  # skip start-up (first syncs, imports)
    busy = act != b"wait"
    inside = np.clip(np.minimum(t1, hi) - np.maximum(t0, lo), 0, None) * busy
    orch = role == b"orchestrator"
    per_rank = np.bincount(rank, weights=inside)
    steps = len(t) - skip
    return {"step_s": float(np.median(np.diff(t[skip - 1:]))),
            "samples_per_s": float(samples[skip:].sum() / (hi - lo)),
            "util": float(inside[~orch].sum() / (workers * (hi - lo))),
            "orch": float(inside[orch].sum() / (hi - lo)),
            "crit_s": float(per_rank.max() / steps)}


def run(config: str, overrides: list[str], out: Path, root: Path = ROOT) -> dict:
    cmd = [sys.executable, "-m", "flexmarl_hpc.run", config, f"run.output_dir={out}",
           "run.log_every=1000", *overrides]
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    p = subprocess.run(cmd, cwd=root, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(root)})
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {**measure(next(out.glob("*.h5"))), "cpu": cpu / wall}


def spread(xs) -> str:
    xs = np.asarray(xs, dtype=float)
    return f"{np.median(xs):.2f} [{xs.min():.2f}, {xs.max():.2f}]"


def report(wl: str, config: str, base: list[str], res: dict[str, list[dict]], cores: int) -> None:
    reps = len(next(iter(res.values())))
    print(f"\n== {wl} ({config} {' '.join(base)}), {cores} cores, {reps} interleaved repetitions")
    print("   median [min, max]")
    print(f"{'variant':15s} " + " ".join(f"{k:>19s}" for k in FIGURES))
    for v, rs in res.items():
        print(f"{v:15s} " + " ".join(f"{spread([r[k] for r in rs]):>19s}" for k in FIGURES))
    for v, rs in res.items():
        name, at, rev = v.partition("@")
        if at and name in res:
            ratio = [r["step_s"] / o["step_s"] for r, o in zip(res[name], rs)]
            print(f"{name}: step time current / {rev} (paired by repetition) {spread(ratio)}")
    ref = res.get("sync")
    if not ref:
        return
    print(f"\nvs sync (paired by repetition) {'speedup':>19s} {'x samples/s':>19s} {'x util':>19s} {'bound':>19s}")
    speed = {}
    for v, rs in res.items():
        if v == "sync" or "@" in v:
            continue
        speed[v] = [s["step_s"] / r["step_s"] for s, r in zip(ref, rs)]
        xs = [r["samples_per_s"] / s["samples_per_s"] for s, r in zip(ref, rs)]
        xu = [r["util"] / s["util"] for s, r in zip(ref, rs)]
        bound = [s["step_s"] / r["crit_s"] for s, r in zip(ref, rs)]
        over = sum(a > b for a, b in zip(speed[v], bound))
        print(f"{v:30s} {spread(speed[v]):>19s} {spread(xs):>19s} {spread(xu):>19s} {spread(bound):>19s}"
              + (f"  (above its bound in {over} reps: the bound is broken)" if over else ""))
    if not speed:
        return
    order = sorted(speed, key=lambda v: -np.median(speed[v]))
    print("ablation ordering (speedup vs sync): " + " > ".join(f"{v} {spread(speed[v])}" for v in order))
    if "flex" in speed:
        for v in order:
            if v != "flex":
                below = sum(a < b for a, b in zip(speed[v], speed["flex"]))
                print(f"  {v} below full flex in {below}/{reps} repetitions")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", nargs="+", default=["referential", "skewed"], choices=list(WORKLOADS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each variant (>= 3 for a spread)")
    ap.add_argument("--steps", type=int, help="override run.steps of every workload (>= 4: 2 are start-up)")
    ap.add_argument("--keep", type=Path, help="keep every run's directory here (for "
                    "python -m flexmarl_hpc.analyze: timeline.png) instead of a temporary one")
    ap.add_argument("--against", metavar="REV", help="also run every variant on git revision REV's code")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    # a kill (SIGTERM) unwinds like Ctrl-C, so the --against worktree is removed, not left registered
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with tempfile.TemporaryDirectory() as tmp:
        roots = {"": ROOT}
        if args.against:
            other = Path(tmp) / "against"
            subprocess.run(["git", "worktree", "add", "--detach", str(other), args.against], cwd=ROOT, check=True,
                           capture_output=True)
            roots[f"@{args.against}"] = other
        try:
            _bench(args, args.keep or Path(tmp), roots, cores)
        finally:
            if args.against:
                subprocess.run(["git", "worktree", "remove", "--force", str(roots[f"@{args.against}"])], cwd=ROOT)


def _bench(args, tmp: Path, roots: dict[str, Path], cores: int) -> None:
    for wl in args.workloads:
        config, base = WORKLOADS[wl]
        if args.steps:
            base = [o for o in base if not o.startswith("run.steps=")] + [f"run.steps={args.steps}"]
        runs = [(v + tag, v, root) for v in args.variants for tag, root in roots.items()]
        res: dict[str, list[dict]] = {name: [] for name, _, _ in runs}
        n = len(runs)
        for rep in range(args.reps):                    # A B C .., B C .. A, ..: drift hits all alike
            for name, v, root in runs[rep % n:] + runs[:rep % n]:
                res[name].append(run(config, base + VARIANTS[v], tmp / f"{wl}-{name}-{rep}", root))
                print(f"  {wl} rep {rep + 1}/{args.reps} {name}: step {res[name][-1]['step_s']:.3f} s",
                      file=sys.stderr, flush=True)
        report(wl, config, base, res, cores)


if __name__ == "__main__":
    main()
