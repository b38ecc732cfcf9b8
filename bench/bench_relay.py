"""The weight-sync chain per hop: our relay against a raw MPI point-to-point chain of the same bytes.

    .venv/bin/python bench/bench_relay.py [--size 82] [--hops 1,2,3,4] [--reps 9] [--bucket-mb 8]

One MPI job of 1 + max(hops) ranks: rank 0 plays a trainer stage sender, ranks 1.. replicas,
all in one (trainer, pool) sync group made at start. For h hops the sync targets replicas
1..h (a chain of h links; the others take no part, as in production). "ours" is the whole
sync (`send_weights` / `receive_weights`: plan rendezvous, tensors packed into buckets, two
sender buffers in turn, each relay landing buckets in two buffers and forwarding each as it
lands); "raw" the same bytes in the same buckets down the same chain with plain MPI
(`Isend`/`Irecv` on a communicator of its own, waited with MPI's `Waitall`; rank 0 sends from
one packed model-sized buffer, at most two buckets in flight; each relay receives into two
buffers in turn and forwards what it got). Ranks outside a sync wait in a sleeping barrier,
so they do not take the cores from the chain. Each repetition runs every (hops, kind) in an
order rotated and reversed from rep to rep. Prints per hop count achieved bytes/s (model
bytes delivered to every replica / wall time) of ours and raw, ours/raw throughput, and the
per-hop efficiency: that ratio at h hops over the ratio at 1 hop, paired per repetition;
all median [min, max].

The 8 MiB default bucket gives an 82 MiB model ~11 buckets, as 1 GiB buckets give a 32B PP
stage ~30: a chain's fill term (one bucket per hop) stays a small part, as it is there.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_weight_sync import model_args  # noqa: E402  (bench/ is this script's folder)


def sleeping_barrier(comm) -> None:
    """A barrier whose waiters sleep (MPI's own polls a core: 5 ranks share 2 here)."""
    from flexmarl_hpc.runtime.backoff import until
    until(comm.Ibarrier().Test)


def timed(comm, fn) -> float:
    sleeping_barrier(comm)
    t = time.perf_counter()
    fn()
    sleeping_barrier(comm)
    return time.perf_counter() - t


def raw_chain(comm, hops: int, whole, sizes: list[int], bufs, sleep: bool = False) -> None:
    """The plain-MPI chain 0 -> 1 -> ... -> hops over bucket `sizes`: rank 0 sends slices of
    `whole`, a relay lands bucket i in bufs[i % 2] and forwards it, the last link receives.
    `sleep`: wait each request as our sync does (back-off sleeps), not in MPI's polling wait."""
    from mpi4py import MPI
    from flexmarl_hpc.runtime.backoff import until
    wait = (lambda reqs: until(lambda: MPI.Request.Testall(reqs))) if sleep else MPI.Request.Waitall
    me = comm.Get_rank()
    if me > hops:
        return
    prev, nxt = me - 1, (me + 1 if me < hops else None)
    sends = [None, None]
    at = 0
    for i, n in enumerate(sizes):
        slot = i % 2
        if sends[slot] is not None:                 # the slot's last bucket is out: reuse it
            wait([sends[slot]])
        if me == 0:
            buf = whole[at:at + n]
        else:
            buf = bufs[slot if nxt is not None else 0][:n]
            wait([comm.Irecv(buf, source=prev, tag=7)])
        if nxt is not None:
            sends[slot] = comm.Isend(buf, dest=nxt, tag=7)
        at += n
    wait([s for s in sends if s is not None])


def run(world, size: str, hops: list[int], reps: int, bucket: int, sleep: bool) -> None:
    from flexmarl_hpc.config.sync_groups import SyncGroup
    from flexmarl_hpc.learn.model import build_model, hf_state_dict
    from flexmarl_hpc.runtime.sync_channels import host_bytes
    from flexmarl_hpc.runtime.weight_sync import (SyncPlan, SyncChannels, dict_bucket, layout_of, pack,
                                                  plan_buckets, receive_weights, send_weights)
    me = world.Get_rank()
    named = hf_state_dict(build_model(model_args(size), seed=0)) if me == 0 else None
    whole = world.bcast(dict_bucket(named) if me == 0 else None, root=0)
    buckets = world.bcast(plan_buckets(layout_of(named), bucket) if me == 0 else None, root=0)
    sizes = [b.total for b in buckets]
    flat = host_bytes(max(sum(sizes), whole.total)).numpy() if me == 0 else None
    if me == 0:                 # raw sends the real parameter bytes, not untouched zero pages
        pack(named, whole, flat[:whole.total])
    bufs = [host_bytes(max(sizes)).numpy() for _ in range(2)]
    comm = world.Dup()
    ch = SyncChannels(world, "mpi")
    ch.open([SyncGroup(0, 0, (0,), tuple(range(1, world.size)))])
    plan = SyncPlan((0,), (buckets,))
    fns = {}
    for h in hops:
        targets = tuple(range(1, h + 1))
        if me == 0:
            fns[h, "ours"] = lambda t=targets: send_weights(ch, t, plan, 1, 0, named.items(), leader=True)
        elif me <= h:
            fns[h, "ours"] = lambda t=targets: [b for b in receive_weights(ch, (0,) + t)[2]]
        else:
            fns[h, "ours"] = lambda: None
        fns[h, "raw"] = lambda h=h: raw_chain(comm, h, flat, sizes, bufs, sleep)
    for f in fns.values():                  # first touch of buffers, the plan sent once
        timed(world, f)
    keys, times = list(fns), {k: [] for k in fns}
    for i in range(reps):
        order = keys[i % len(keys):] + keys[:i % len(keys)]
        for k in (order if i % 2 == 0 else order[::-1]):
            times[k].append(timed(world, fns[k]))
    if me == 0:
        report(size, whole.total, bucket, len(sizes), hops, times, reps)
    ch.close()
    comm.Free()


QWEN32B = dict(hidden=5120, layers=64, inter=27648, heads=40, kv_heads=8, head_dim=128, vocab=152064)
"""Qwen2.5-32B's config.json shapes (untied embeddings, q/k/v biases)."""
REPLICAS, TP, PP, HARDWARE = 21, 4, 2, "configs/hardware/h100_ndr.yaml"
"""One 32B agent's sync in the paper job: ~21 TP-4 replicas (p32: 64 serving 3 agents), the
trainer's PP 2 stages, over 400 Gb/s NDR and NVLink (the hardware file gives both)."""


def qwen32b_bytes() -> int:
    """bf16 bytes of Qwen2.5-32B's weights (32.76e9 parameters)."""
    q = QWEN32B
    kv = q["kv_heads"] * q["head_dim"]
    attn = 2 * q["hidden"] * q["hidden"] + 2 * q["hidden"] * kv + q["hidden"] + 2 * kv
    layer = attn + 3 * q["hidden"] * q["inter"] + 2 * q["hidden"]
    return 2 * (q["layers"] * layer + 2 * q["vocab"] * q["hidden"] + q["hidden"])


def estimate_32b(eff: list[float]) -> list[str]:
    """The 32B sync time from the chain's measured efficiency `eff` (ours/raw bytes/s at
    the hop count where its median is lowest): T = [S/B_nic + P x ((n_nic - 1) b/B_nic +
    n_nv b/B_nv)] / e, the raw chain's time (every link at its rate, the fill of one bucket
    per further link paid per PP stage: receivers take stage 0, then stage 1) over e."""
    import numpy as np
    import yaml
    hw = yaml.safe_load(Path(HARDWARE).read_text())
    nbytes, b_nic, b_nv = qwen32b_bytes(), hw["nic_gb_s"] * 1e9, hw["intra_node_gb_s"] * 1e9
    per_node = hw["devices_per_node"] // TP
    n_nic = -(-REPLICAS // per_node)                    # node crossings, the sender's included
    n_nv = REPLICAS * TP - n_nic                        # links inside a node
    floor = nbytes / b_nic
    out = [f"32B estimate: S = {nbytes / 1e9:.1f} GB (Qwen2.5-32B bf16), B_nic = {b_nic / 1e9:g} GB/s, "
           f"B_nv = {b_nv / 1e9:g} GB/s ({HARDWARE}), {REPLICAS} TP-{TP} replicas, {per_node} a node: "
           f"{n_nic} NIC + {n_nv} NVLink links, P = {PP} stages; floor S/B_nic = {floor:.2f} s",
           f"  e = ours/raw at the worst hop count: {spread(eff, '.2f')}"]
    for mib in (1024, 256):
        b = mib * 2**20
        raw = floor + PP * ((n_nic - 1) * b / b_nic + n_nv * b / b_nv)
        t = raw / np.array(eff)
        out.append(f"  {mib:4d} MiB buckets: raw chain {raw:.2f} s, ours {spread(t, '.2f')} s = "
                   f"{spread(t / floor, '.2f')}x the floor (goal <= 2x)")
    return out


def spread(xs, fmt: str) -> str:
    import numpy as np
    return f"{np.median(xs):{fmt}} [{np.min(xs):{fmt}}, {np.max(xs):{fmt}}]"


def report(size, nbytes, bucket, nbuckets, hops, times, reps) -> None:
    import numpy as np
    t = {k: np.array(v) for k, v in times.items()}
    print(f"{size} ({nbytes / 2**20:.1f} MiB), {nbuckets} buckets of <= {bucket / 2**20:g} MiB, {reps} interleaved "
          f"reps: median [min, max]", flush=True)
    base = t[hops[0], "raw"] / t[hops[0], "ours"]
    for h in hops:
        ratio = t[h, "raw"] / t[h, "ours"]          # ours/raw in bytes/s
        print(f"  {h} hop(s): ours {spread(nbytes / t[h, 'ours'] / 1e9, '.2f')} GB/s  raw "
              f"{spread(nbytes / t[h, 'raw'] / 1e9, '.2f')} GB/s  ours/raw {spread(ratio, '.2f')}  "
              f"vs {hops[0]} hop {spread(ratio / base, '.2f')}", flush=True)
    worst = min(hops, key=lambda h: np.median(t[h, "raw"] / t[h, "ours"]))
    print("\n".join(estimate_32b(list(t[worst, "raw"] / t[worst, "ours"]))), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="82", help="MiB of a Llama-shaped model, or smollm2")
    ap.add_argument("--hops", default="1,2,3,4")
    ap.add_argument("--reps", type=int, default=15)   # 8 runs a rep, ~1 s: spread is cheap to narrow
    ap.add_argument("--bucket-mb", type=float, default=8.0)
    ap.add_argument("--raw-wait", choices=("mpi", "sleep"), default="mpi",
                    help="raw waits in MPI's polling Waitall, or with our back-off sleeps")
    args = ap.parse_args()
    hops = [int(h) for h in args.hops.split(",")]
    if "PMI_RANK" not in os.environ:
        mpiexec = Path(sys.executable).parent / "mpiexec"
        sys.exit(subprocess.call([str(mpiexec), "-n", str(max(hops) + 1), sys.executable, *sys.argv]))
    import torch
    from mpi4py import MPI
    torch.set_num_threads(1)
    run(MPI.COMM_WORLD, args.size, hops, args.reps, int(args.bucket_mb * 2**20), args.raw_wait == "sleep")


if __name__ == "__main__":
    main()
