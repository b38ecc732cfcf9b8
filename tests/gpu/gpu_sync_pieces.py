"""Sync pieces on a real GPU (one rank, NCCL): tensors larger than a bucket go in row pieces,
so the sender's CUDA allocations during a sync stay within two buckets
(torch.cuda.max_memory_allocated), also streamed as a sharded trainer streams them (each split
tensor as the plan's row ranges, `weight_sync.row_pieces`, assembled in place in the bucket
being filled, `weight_sync.Destination`); and the bytes each broadcast carried, landed in place in
one device buffer (`landing`, `received`), give every tensor back bit-equal to the bf16 cast
of the trainer's (a non-contiguous one included).

    python tests/gpu/gpu_sync_pieces.py          # prints the sender's peak; asserts the bounds
    pytest tests/gpu/gpu_sync_pieces.py          # skipped without a GPU

One GPU cannot hold two NCCL ranks, so the broadcast is a one-member group's (a no-op on
the bytes); bit-equality over real transfers is tests/mpi/test_weight_sync.py's (gloo, MPI).
On a tree without pieces (before 2026-11-26) it prints the peak and skips the asserts.
"""
from __future__ import annotations

import pytest

MIB = 2**20


def _weights(torch):
    g = torch.Generator(device="cuda").manual_seed(0)
    return {"embed": torch.randn(8192, 1024, generator=g, device="cuda"),         # 32 MiB fp32, 16 bf16
            "norm": torch.randn(1024, generator=g, device="cuda"),
            "head": torch.randn(1024, 8192, generator=g, device="cuda").T,        # non-contiguous
            "mlp": torch.randn(2816, 1024, generator=g, device="cuda")}


def _ranges(named, pieces, dest):
    """The stream a sharded trainer sends: a split tensor as its row ranges, each assembled in
    place in the bucket being filled (its TP gather, trainer/megatron/trainer.py `sync_stream`
    with a Destination: `dest.rows`, cast to the wire dtype on copy), the rest whole."""
    for k, v in named.items():
        if k not in pieces:
            yield k, v
        for a, b in pieces.get(k, []):
            rows = dest.rows(k, (b - a, *v.shape[1:]), v)
            rows.copy_(v[a:b])
            yield k, rows
            del rows


def check() -> str:
    import torch
    from mpi4py import MPI
    from flexmarl_hpc.runtime import sync_channels as G
    from flexmarl_hpc.runtime import weight_sync as W
    torch.cuda.set_device(0)
    ch = W.SyncChannels(MPI.COMM_SELF, "nccl")
    # the (trainer group, pool) pair as SyncChannels.open makes it, with one replica (rank 1)
    # that cannot exist on one GPU (NCCL refuses two ranks on a device): each bucket's send
    # to it is recorded instead (`W._isend`), everything else is the production sender
    pair = G.Pair((0, 0), (0,), (1,), MPI.COMM_SELF, first={0: 0, 1: 1}, count={0: 1, 1: 1})
    ch.pairs[pair.key] = pair
    named, bucket, wire = _weights(torch), 4 * MIB, torch.bfloat16
    plan = W.SyncPlan((0,), (W.plan_buckets(W.layout_of(named), bucket, wire),))
    sent, real, keep = [], W._isend, [False]

    def recording(channels, pair, flat, dst):
        assert flat.device.type == "cuda" and dst == 1
        if keep[0]:
            sent.append(flat.clone())   # before the sender refills it (stream order)
        return []
    W._isend = recording
    try:
        return _measure(torch, W, ch, plan, named, bucket, wire, sent, keep)
    finally:
        W._isend = real


def _measure(torch, W, ch, plan, named, bucket, wire, sent, keep) -> str:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    W.send_weights(ch, (1,), plan, 1, 0, named.items(), leader=False)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    line = (f"gpu sync pieces: sender peak {peak / MIB:.2f} MiB with {bucket // MIB} MiB buckets, largest tensor "
            f"{8192 * 1024 * 2 / MIB:.0f} MiB (bf16), {len(plan.stages[0])} buckets")
    if not hasattr(W, "Piece"):
        ch.close()
        return line + " (a tree without pieces: no asserts)"
    assert peak <= 2 * bucket, line
    # a sharded trainer (megatron's sync_stream) streams a split tensor as the plan's row
    # ranges, each gathered in place in the bucket being filled: nothing beside the buffers
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    dest = W.Destination(plan)
    W.send_weights(ch, (1,), plan, 1, 0, _ranges(named, W.row_pieces(plan), dest), leader=False, dest=dest)
    torch.cuda.synchronize()
    ranged = torch.cuda.max_memory_allocated() - base
    line += f"; streamed as row ranges in place {ranged / MIB:.2f} MiB (2 buckets)"
    assert ranged <= 2 * bucket, line
    # the same sync again, each bucket's bytes kept (a copy per bucket: after the peak was read)
    keep[0] = True
    W.send_weights(ch, (1,), plan, 2, 0, named.items(), leader=False)
    buf, got = torch.zeros(plan.span, dtype=torch.uint8, device="cuda"), {}
    for b, data in zip(plan.stages[0], sent):
        W.landing(b, buf).copy_(data)
        got.update({k: v.clone() for k, v in W.received(b, buf).items()})
    assert sorted(got) == sorted(named), sorted(got)
    for k, v in named.items():
        assert torch.equal(got[k], v.to(wire)), k
    ch.close()
    return line + f"; {sum(b.piece is not None for b in plan.stages[0])} pieces landed bit-equal"


@pytest.mark.gpu
def test_sync_pieces_keep_the_sender_within_two_buckets_on_a_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    # a fresh process: after tests/gpu/gpu_sync_deadline.py's NCCL group in the same process
    # the peak read 9.00 MiB (1 MiB more, seen on an H200 2026-11-26), a state the earlier
    # test leaves, not the sync's buffers; alone and after the megatron check it reads 8.00
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, __file__], cwd=root, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))})
    print(p.stdout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]


if __name__ == "__main__":
    print(check())
