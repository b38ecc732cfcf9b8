"""Weight sync vs a raw MPI.Bcast of the same bytes, in one run.

    .venv/bin/python bench/bench_weight_sync.py [--mb 64] [--ranks 3] [--bucket-mb 4] [--reps 10]

Rank 0 plays a trainer leader holding HF-named float32 tensors (a Llama-shaped model of
about --mb MiB); the other ranks play replicas. Prints the median time of our bucketed
`broadcast_weights` (header + buckets + unpack into tensors) and of one blocking
`MPI.Bcast` of the same number of bytes, and their ratio.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=64)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=4)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    if "PMI_RANK" not in os.environ:
        mpiexec = Path(sys.executable).parent / "mpiexec"
        sys.exit(subprocess.call([str(mpiexec), "-n", str(a.ranks), sys.executable, *sys.argv]))

    import numpy as np
    import torch
    from mpi4py import MPI
    from flexmarl_hpc.model import ModelArgs, build_model, hf_state_dict
    from flexmarl_hpc.trainer.torch_trainer import flatten_parameters
    from flexmarl_hpc.weight_sync import SyncChannels, broadcast_weights

    world = MPI.COMM_WORLD
    hidden = 512
    per_layer = 12 * hidden * hidden * 4
    layers = max(1, int(a.mb * 2**20 / per_layer))
    args = ModelArgs(vocab_size=1000, hidden_size=hidden, num_layers=layers, num_heads=8, num_kv_heads=8,
                     intermediate_size=4 * hidden, max_seq_len=64)
    named, packed = None, None
    if world.rank == 0:                       # a trainer's parameters live in sync layout
        model = build_model(args, seed=0)
        packed = flatten_parameters(model)
        named = hf_state_dict(model)
    members = tuple(range(world.size))
    channels = SyncChannels(world)
    comm = channels.get(members)
    bucket = int(a.bucket_mb * 2**20)
    nbytes = sum(t.numel() * 4 for t in named.values()) if world.rank == 0 else 0
    nbytes = world.bcast(nbytes, root=0)
    ours, raw = [], []
    buf = np.zeros(nbytes, dtype=np.uint8)          # allocated and touched once, like our staging
    for _ in range(a.reps):
        world.Barrier()
        t = time.perf_counter()
        broadcast_weights(comm, named, 1, bucket, staging=lambda n: channels.buffer(members, n),
                          packed=packed)
        world.Barrier()
        ours.append(time.perf_counter() - t)
        world.Barrier()
        t = time.perf_counter()
        comm.Bcast(buf, root=0)
        world.Barrier()
        raw.append(time.perf_counter() - t)
    if world.rank == 0:
        o, r = float(np.median(ours)), float(np.median(raw))
        print(f"weight sync {nbytes / 2**20:.1f} MiB to {world.size - 1} replicas, bucket {a.bucket_mb} MiB, "
              f"{a.reps} reps (median)")
        print(f"  broadcast_weights : {o * 1e3:8.1f} ms  ({nbytes / 2**30 / o:.2f} GiB/s)")
        print(f"  raw MPI.Bcast     : {r * 1e3:8.1f} ms  ({nbytes / 2**30 / r:.2f} GiB/s)")
        print(f"  ratio ours/raw    : {o / r:.2f}")


if __name__ == "__main__":
    main()
