"""How many cores this machine gives ranks that compute at once (the simulator's `shared_cores`).

    .venv/bin/python bench/bench_cores.py [--procs 2] [--reps 5] [--calls 6]
    .venv/bin/python bench/bench_cores.py --procs 2 --pollers 4     # waiting_share

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

`--pollers K` instead times the `--procs` processes at once without and with K more that
wait as a run's idle ranks do (`Iprobe` and flexmarl_hpc.runtime.comm's back-off sleep, for a
message that never comes), interleaved, and prints

    waiting share = procs x (time with pollers / time without - 1) / K

the share of a core each waiting rank takes from ranks computing on full cores (its own few
percent of CPU, and the preemptions its wake-ups cost them): the profile's `waiting_share`,
under which the simulator runs w computing ranks with r waiting at
min(1, cores / (w + waiting_share x r)) of a core once w >= cores.
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
    from flexmarl_hpc.config.hf_config import model_args
    from flexmarl_hpc.config.plan import resolve
    from flexmarl_hpc.ranks.build import build_engine
    from flexmarl_hpc.workflows.build import build_task
    from flexmarl_hpc.learn.model import CausalLM
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.rollout.base import GenRequest
    from flexmarl_hpc.learn.sampling import SamplingParams
    cfg = load_config(str(ROOT / "configs/skewed.yaml"), ["run.eval_every=0"])
    task = build_task(cfg)
    engine = build_engine(resolve(cfg), task)
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


def poller(stop) -> None:
    """An idle rank: flexmarl_hpc.runtime.comm's wait loop on a message that never comes."""
    sys.path.insert(0, str(ROOT))
    from mpi4py import MPI
    from flexmarl_hpc.runtime.comm import Backoff
    while not stop.is_set():
        b = Backoff()
        for _ in range(1000):                   # ~0.5 s of waiting, then look at `stop`
            if MPI.COMM_SELF.Iprobe():
                break
            b.sleep()


def timed(pipes) -> float:
    """Mean seconds of each process's calls, all running at once."""
    for p in pipes:
        p.send("run")
    return statistics.mean(p.recv() for p in pipes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--pollers", type=int, default=0,
                    help="measure the waiting share of this many idle (polling) ranks instead")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    pipes = []
    for _ in range(args.procs):
        mine, theirs = ctx.Pipe()
        ctx.Process(target=worker, args=(theirs, args.calls), daemon=True).start()
        pipes.append(mine)
    for p in pipes:
        assert p.recv() == "ready"
    if args.pollers:
        return waiting_share(ctx, pipes, args)
    alone, together, cores = [], [], []
    for rep in range(args.reps):
        for side in (("alone", "together") if rep % 2 == 0 else ("together", "alone")):
            (alone if side == "alone" else together).append(timed(pipes[:1] if side == "alone" else pipes))
        cores.append(args.procs * alone[-1] / together[-1])
    for p in pipes:
        p.send("stop")
    print(f"torch engine, skewed writer batch x {args.calls} calls per process, {args.reps} interleaved reps")
    print(f"  1 process alone            : {spread(alone)} s")
    print(f"  each of {args.procs} processes at once: {spread(together)} s")
    print(f"  effective cores ({args.procs} x alone / at once): {spread(cores)}")



def waiting_share(ctx, pipes, args) -> None:
    without, with_, share = [], [], []
    for rep in range(args.reps):
        for side in (("without", "with") if rep % 2 == 0 else ("with", "without")):
            stop, polling = ctx.Event(), []
            if side == "with":
                polling = [ctx.Process(target=poller, args=(stop,), daemon=True) for _ in range(args.pollers)]
                for q in polling:
                    q.start()
                time.sleep(2.0)                 # imported and polling before the timing starts
            (with_ if side == "with" else without).append(timed(pipes))
            stop.set()
            for q in polling:
                q.join()
        share.append(args.procs * (with_[-1] / without[-1] - 1) / args.pollers)
    for p in pipes:
        p.send("stop")
    print(f"torch engine, skewed writer batch x {args.calls} calls, {args.procs} processes at once, {args.reps} interleaved reps")
    print(f"  without pollers            : {spread(without)} s")
    print(f"  with {args.pollers} polling ranks      : {spread(with_)} s")
    print(f"  waiting share per rank (procs x (with / without - 1) / pollers): {spread(share)}")


def spread(xs) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]"


if __name__ == "__main__":
    main()
