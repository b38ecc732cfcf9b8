"""Memory of a megatron checkpoint save: ours vs megatron's own gather and writer, in one run.

    .venv/bin/python bench/bench_ckpt_memory.py [--size smollm2] [--reps 3]

Each repetition starts one process per variant (interleaved, the order reversed every other
rep): it builds a one-rank megatron trainer (`--size`: `smollm2`, the SmolLM2-135M shape, or
MiB of an fp32 Llama-shaped model as in bench_weight_sync), saves once (Adam's moments
exist from then on), then saves again while a thread samples its RSS every 5 ms.

  ours     : `save_checkpoint` as a job runs it (flexmarl_hpc/trainer/megatron/dist_ckpt.py):
             the one-DP-rank gather fills the world tensors directly, the writer aliases views;
  megatron : the same call with those two replaced by megatron's own: its gather (local
             shard, receive list, concatenation) and its writer's up-front clone of every view.

Prints, per variant, the steady RSS before the second save and the peak above it, median
[min, max] in GB, in units of the model's fp32 bytes, and the ratio of the two peaks.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("ours", "megatron")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def child(size: str, variant: str) -> None:
    """One variant's save, measured; prints one JSON line."""
    import torch
    from mpi4py import MPI

    from bench.bench_weight_sync import model_args
    from flexmarl_hpc.config.schema import TrainerConfig
    from flexmarl_hpc.trainer.megatron import MegatronTrainer, dist_ckpt
    torch.set_num_threads(1)
    if variant == "megatron":
        dist_ckpt._gather_without_copies = lambda opt: None
        dist_ckpt._ExactStorages = lambda planner: planner
    args = model_args(size)
    trainer = MegatronTrainer(args, TrainerConfig(backend="megatron"), MPI.COMM_SELF, 1.0)
    model_bytes = 4 * sum(p.numel() for p in trainer.gpt.parameters())
    peak, sampling = [0], [True]

    def sample() -> None:
        while sampling[0]:
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.005)

    with tempfile.TemporaryDirectory() as d:
        trainer.version = 1
        trainer.save_checkpoint(d)
        steady = rss_bytes()
        peak[0] = steady
        thread = threading.Thread(target=sample)
        thread.start()
        trainer.version = 2
        t0 = time.perf_counter()
        trainer.save_checkpoint(d)
        seconds = time.perf_counter() - t0
        sampling[0] = False
        thread.join()
    print(json.dumps({"variant": variant, "steady": steady, "extra": peak[0] - steady,
                      "model_bytes": model_bytes, "seconds": seconds}))


def spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}, {fmt.format(max(xs))}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="smollm2", help="smollm2, or MiB of an fp32 Llama-shaped model")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.size, args.child)
        return 0
    root = Path(__file__).resolve().parents[1]
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for rep in range(args.reps):
        for v in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):
            p = subprocess.run([sys.executable, __file__, "--size", args.size, "--child", v], cwd=root,
                               capture_output=True, text=True, env={"PYTHONWARNINGS": "ignore", **os.environ})
            lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
            if p.returncode != 0 or not lines:
                print(f"{v} (rep {rep}) failed:\n{p.stderr[-3000:]}", file=sys.stderr)
                return 1
            runs[v].append(json.loads(lines[-1]))
    gb = 1e9
    model = runs["ours"][0]["model_bytes"]
    print(f"megatron checkpoint save, {args.size} ({model / gb:.2f} GB fp32 weights), one rank, {args.reps} reps")
    for v in VARIANTS:
        r = runs[v]
        print(f"  {v:9s} steady {spread([x['steady'] / gb for x in r])} GB   "
              f"peak above steady {spread([x['extra'] / gb for x in r])} GB "
              f"= {spread([x['extra'] / model for x in r], '{:.1f}')} x weights   "
              f"save {spread([x['seconds'] for x in r], '{:.1f}')} s")
    ratio = [o["extra"] / m["extra"] for o, m in zip(runs["ours"], runs["megatron"])]
    print(f"  ours/megatron peak above steady: {spread(ratio)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
