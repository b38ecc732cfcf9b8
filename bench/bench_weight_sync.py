"""Streaming weight sync vs a raw broadcast of the same bytes on the same backend, in one run.

    .venv/bin/python bench/bench_weight_sync.py [--sizes 82,smollm2] [--replicas 1,2]
                                                [--backends mpi,gloo] [--reps 9] [--bucket-mb 64]

For each replica count one MPI job (1 + replicas ranks) is started; rank 0 plays a trainer
stage sender (the torch trainer's stream: its HF tensors one by one), the others play
replicas, all in one (trainer, pool) sync group. Per size (`82`: an 82 MiB Llama-shaped model; `smollm2`: the SmolLM2-135M shape,
~513 MiB fp32) and backend, "ours" is the whole sync (`send_weights` / `receive_weights`:
plan rendezvous, tensors packed into buckets of --bucket-mb, two sender buffers in turn,
each bucket received, forwarded down the chain of replicas and unpacked into tensors)
and "raw" one broadcast of the same bytes
from one model-sized buffer (the root sends the real parameter bytes, not an untouched
buffer whose zero pages would sit in cache) on the same backend (`MPI.Bcast`, or the gloo
group's `broadcast`). Each repetition runs every (backend, ours/raw) pair, in an order
rotated and reversed from rep to rep so drift hits all; prints median [min, max] of ours/raw
per backend, and of gloo/mpi (ours). Memory: the sender's peak extra tensor bytes during its
first sync (bucket buffers included; runtime/memtrack.TensorBytes) against the model's.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def model_args(size: str):
    from flexmarl_hpc.learn.model import ModelArgs
    if size == "smollm2":       # SmolLM2-135M: 576 hidden, 30 layers, 9/3 heads, tied 49152 vocab
        return ModelArgs(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                         intermediate_size=1536, max_seq_len=64, tie_embeddings=True)
    hidden = 512
    layers = max(1, round(float(size) * 2**20 / (16 * hidden * hidden * 4)))   # 16 h^2 fp32 per layer
    return ModelArgs(vocab_size=1000, hidden_size=hidden, num_layers=layers, num_heads=8, num_kv_heads=8,
                     intermediate_size=4 * hidden, max_seq_len=64)


def timed(world, fn) -> float:
    world.Barrier()
    t = time.perf_counter()
    fn()
    world.Barrier()
    return time.perf_counter() - t


def run_size(world, size: str, backends: list[str], reps: int, bucket: int) -> None:
    """Every backend's ours and raw, interleaved in each repetition (order rotated per rep)."""
    import numpy as np
    import torch
    from flexmarl_hpc.learn.model import build_model, hf_state_dict
    from flexmarl_hpc.runtime.memtrack import TensorBytes
    from flexmarl_hpc.config.sync_groups import SyncGroup
    from flexmarl_hpc.runtime.weight_sync import (SyncPlan, SyncChannels, dict_bucket, layout_of, pack,
                                                  plan_buckets, receive_weights, send_weights)

    named = None
    if world.rank == 0:
        named = hf_state_dict(build_model(model_args(size), seed=0))
    members = tuple(range(world.size))
    whole = world.bcast(dict_bucket(named) if world.rank == 0 else None, root=0)
    raw_buf = torch.ones(whole.total, dtype=torch.uint8)
    if world.rank == 0:
        pack(named, whole, raw_buf)
    fns, chans, peaks = {}, [], {}
    for backend in backends:
        ch = SyncChannels(world, backend)
        ch.open([SyncGroup(0, 0, (0,), members[1:])])       # the (trainer, pool) group, made at start
        pair = ch.pairs[0, 0]
        chans.append(ch)
        if world.rank == 0:
            plan = SyncPlan((0,), (plan_buckets(layout_of(named), bucket),))
            fns[backend, "ours"] = lambda ch=ch, plan=plan: send_weights(ch, members[1:], plan, 1, 0,
                                                                         named.items(), leader=True)
        else:
            fns[backend, "ours"] = lambda ch=ch: [b for b in receive_weights(ch, members)[2]]
        if backend == "mpi":
            fns[backend, "raw"] = lambda comm=pair.comm: comm.Bcast(raw_buf.numpy(), root=0)
        else:
            def raw(pg=pair.pg):
                opts = torch.distributed.BroadcastOptions()
                opts.rootRank = 0
                pg.broadcast([raw_buf], opts).wait()
            fns[backend, "raw"] = raw
    for (backend, kind), f in fns.items():        # groups, buffers, first touch: once per run
        with TensorBytes() as mem:
            f()
        peaks[backend, kind] = mem.peak
    times = {k: [] for k in fns}
    keys = list(fns)
    for i in range(reps):
        order = keys[i % len(keys):] + keys[:i % len(keys)]
        for k in (order if i % 2 == 0 else order[::-1]):
            times[k].append(timed(world, fns[k]))
    if world.rank == 0:
        report(size, world.size - 1, whole.total, bucket, backends, times, peaks, reps)
    for ch in chans:
        ch.close()


def report(size, replicas, nbytes, bucket, backends, times, peaks, reps) -> None:
    import numpy as np
    t = {k: np.array(v) for k, v in times.items()}
    head = f"{size:>8} ({nbytes / 2**20:5.1f} MiB) x {replicas} replica(s)"
    for b in backends:
        r = t[b, "ours"] / t[b, "raw"]
        print(f"{head} {b:4}: ours {np.median(t[b, 'ours']) * 1e3:7.1f} ms  raw "
              f"{np.median(t[b, 'raw']) * 1e3:7.1f} ms  ours/raw {np.median(r):.2f} "
              f"[{r.min():.2f}, {r.max():.2f}]  ({reps} reps)", flush=True)
    if "mpi" in backends and "gloo" in backends:
        r = t["gloo", "ours"] / t["mpi", "ours"]
        print(f"{head}     : ours gloo/mpi {np.median(r):.2f} [{r.min():.2f}, {r.max():.2f}]", flush=True)
    peak = max(peaks[b, "ours"] for b in backends)
    print(f"{head}     : sender peak extra {peak / 2**20:.1f} MiB with {bucket / 2**20:.0f} MiB buckets "
          f"(model {nbytes / 2**20:.1f} MiB, {peak / nbytes:.2f}x)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="82,smollm2", help="comma list: MiB of a Llama-shaped model, or smollm2")
    ap.add_argument("--replicas", default="1,2")
    ap.add_argument("--backends", default="mpi,gloo")
    ap.add_argument("--reps", type=int, default=9)   # 3 ranks on 2 cores: 5 left medians to chance
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    args = ap.parse_args()
    if "PMI_RANK" not in os.environ:
        mpiexec = Path(sys.executable).parent / "mpiexec"
        rc = 0
        for n in args.replicas.split(","):
            rc |= subprocess.call([str(mpiexec), "-n", str(int(n) + 1), sys.executable, *sys.argv])
        sys.exit(rc)
    import torch
    from mpi4py import MPI
    torch.set_num_threads(1)
    for size in args.sizes.split(","):
        run_size(MPI.COMM_WORLD, size, args.backends.split(","), args.reps, int(args.bucket_mb * 2**20))


if __name__ == "__main__":
    main()
