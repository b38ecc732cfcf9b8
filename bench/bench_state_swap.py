"""Swap one agent out to host memory and back in: offload/onload (the module, optimizer and
preallocated host buffers kept) against the copy+rebuild path it replaces (a host copy of
`state()`, then a new trainer built and loaded), on the same trainer, interleaved.

    .venv/bin/python bench/bench_state_swap.py [--hidden 512 --layers 4 --reps 5]

Prints each path's round-trip seconds and the ratio rebuild / offload, median [min, max].
CPU here: "device" and host are the same memory, so this measures the bookkeeping (model
construction, state_dict walks, allocation) that a swap no longer does; on GPUs the copies
are additionally pinned and asynchronous.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from mpi4py import MPI

from flexmarl_hpc.config.schema import TrainerConfig
from flexmarl_hpc.learn.grpo import MicroBatch
from flexmarl_hpc.learn.model import ModelArgs, build_model
from flexmarl_hpc.runtime.state_swap import Location, StateMover
from flexmarl_hpc.trainer.torch_trainer import TorchTrainer


class Plain:
    """The same trainer seen without offload/onload: the mover takes the old path."""

    def __init__(self, inner: TorchTrainer) -> None:
        self.inner = inner

    def state(self):
        return self.inner.state()

    def load_state(self, st) -> None:
        self.inner.load_state(st)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    args = ModelArgs(vocab_size=1024, hidden_size=args.hidden, num_layers=args.layers, num_heads=8,
                     num_kv_heads=8, intermediate_size=4 * args.hidden, max_seq_len=64)
    make = lambda: TorchTrainer(build_model(args, 0), TrainerConfig(lr=1e-3), MPI.COMM_SELF, 1.0)
    tr = make()
    g = torch.Generator().manual_seed(0)
    tr.forward_backward(MicroBatch(torch.randint(3, 1024, (2, 16), generator=g), torch.full((2,), 4),
                                   torch.full((2,), 12), torch.zeros(2, 16), torch.randn(2, generator=g),
                                   torch.zeros(2, dtype=torch.bool), None), 0.5)
    tr.optimizer_step()                                  # Adam moments exist
    nbytes = sum(v.numel() * v.element_size() for v in tr.state().values())
    fast = StateMover(MPI.COMM_SELF, MPI.COMM_SELF, 0, lambda g: [0], {"a": tr}, None)
    slow = StateMover(MPI.COMM_SELF, MPI.COMM_SELF, 0, lambda g: [0], {"a": Plain(tr)},
                      lambda agent: Plain(make()))
    out, back = (Location(0, True), Location(0, False)), (Location(0, False), Location(0, True))

    def round_trip(m: StateMover) -> float:
        t0 = time.perf_counter()
        m.move("a", *out)
        m.move("a", *back)
        return time.perf_counter() - t0

    round_trip(fast)                                     # first swap allocates the host buffers
    times = {"offload": [], "rebuild": []}
    for _ in range(args.reps):
        times["offload"].append(round_trip(fast))
        times["rebuild"].append(round_trip(slow))
    ratios = [r / o for r, o in zip(times["rebuild"], times["offload"])]
    print(f"state {nbytes / 2**20:.1f} MiB (params + Adam), {args.reps} interleaved reps")
    for k, v in times.items():
        print(f"  {k:8s} round trip {statistics.median(v):.3f} s [{min(v):.3f}, {max(v):.3f}]")
    print(f"  rebuild / offload: {statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]")


if __name__ == "__main__":
    main()
