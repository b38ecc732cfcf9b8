"""How many cores this machine gives ranks that compute at once (the simulator's `shared_cores`).

    .venv/bin/python bench/bench_cores.py [--procs 2] [--reps 5] [--calls 6]

A rollout replica's real work, the torch engine of `configs/skewed.yaml` generating its
writer turn (16 requests, up to 160 tokens, one torch thread per process as in a run), runs
in one process alone, then in `--procs` processes at once, interleaved A/B `--reps` times
(the processes are started once, the engines built and warmed before any timing). Each
process times the same `--calls` generate calls, so

    effective cores = procs x (time alone / mean time of each process when all run at once)

is `procs` on a machine with that many free cores, and fewer when the vCPUs share a physical
core's execution units or caches (a VM's vCPUs may be hyperthreads of one core) or other jobs
load it. Printed as median [min, max] over the reps; the simulator's `cpu_local` profile
takes its `shared_cores` from this figure (processor sharing: ranks computing w in all run
at min(1, shared_cores / w) of a core each, sim/cores.py).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(conn, calls: int) -> None:
    sys.path.insert(0, str(ROOT))
    import torch
    torch.set_num_threads(1)
    from flexmarl_hpc.build import build_engine, build_task, model_args
    from flexmarl_hpc.model import CausalLM
    from flexmarl_hpc.config import load_config
    from flexmarl_hpc.rollout.base import GenRequest
    from flexmarl_hpc.sampling import SamplingParams
    cfg = load_config(str(ROOT / "configs/skewed.yaml"), ["run.eval_every=0"])
    task = build_task(cfg)
    engine = build_engine(cfg, task)
    writer = cfg.workflow.turns[-1]
    torch.manual_seed(0)                        # a random-init writer, as at version 0 of a run
    engine.load_weights(writer.agent, 0, CausalLM(model_args(cfg, task, writer.agent)).state_dict())
    prompt = list(range(3, 12))                 # 9 tokens, the writer's prompt length in a run
    requests = [GenRequest(f"s{i}", list(prompt), i, writer.max_new_tokens, len(cfg.workflow.turns) - 1)
                for i in range(16)]
    params = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p)
    engine.generate(writer.agent, requests, params)                 # warm-up, untimed
    conn.send("ready")
    while conn.recv() == "run":
        t = time.perf_counter()
        for _ in range(calls):
            engine.generate(writer.agent, requests, params)
        conn.send(time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls", type=int, default=6)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    pipes = []
    for _ in range(a.procs):
        mine, theirs = ctx.Pipe()
        ctx.Process(target=worker, args=(theirs, a.calls), daemon=True).start()
        pipes.append(mine)
    for p in pipes:
        assert p.recv() == "ready"
    alone, together, cores = [], [], []
    for rep in range(a.reps):
        for side in (("alone", "together") if rep % 2 == 0 else ("together", "alone")):
            running = pipes[:1] if side == "alone" else pipes
            for p in running:
                p.send("run")
            times = [p.recv() for p in running]
            (alone if side == "alone" else together).append(statistics.mean(times))
        cores.append(a.procs * alone[-1] / together[-1])
    for p in pipes:
        p.send("stop")
    spread = lambda xs: f"{statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]"   # noqa: E731
    print(f"torch engine, skewed writer batch x {a.calls} calls per process, {a.reps} interleaved reps")
    print(f"  1 process alone            : {spread(alone)} s")
    print(f"  each of {a.procs} processes at once: {spread(together)} s")
    print(f"  effective cores ({a.procs} x alone / at once): {spread(cores)}")


if __name__ == "__main__":
    main()
