"""Structural test of the NCCL branch of the weight broadcast (the CPU torch build has no
ProcessGroupNCCL): a fake records how the group is built and what is broadcast, in a
one-rank member set; the same branch runs over gloo for real in tests/mpi/mpi_weight_sync.py."""
from __future__ import annotations

import torch
import torch.distributed as dist
from mpi4py import MPI

from flexmarl_hpc.runtime import weight_sync as W


class FakeNCCL:
    built: list["FakeNCCL"] = []

    class Options:
        _timeout = None

    def __init__(self, store, rank, size, opts):
        self.rank, self.size, self.opts, self.sent = rank, size, opts, []
        FakeNCCL.built.append(self)

    def broadcast(self, tensors, opts):
        self.sent.append((tensors[0].clone(), opts.rootRank))
        return type("Work", (), {"wait": lambda self: True, "is_completed": lambda self: True})()


def test_nccl_branch_builds_one_group_per_member_set_and_sends_bf16(monkeypatch):
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    FakeNCCL.built = []
    world = MPI.COMM_WORLD
    me = (world.Get_rank(),)
    ch = W.SyncChannels(world, "nccl", device="cpu")      # staging would be on the GPU
    named = {"a.weight": torch.randn(3, 5), "b.bias": torch.randn(7), "step": torch.tensor([4])}
    wire = W.wire_dtype("auto", "vllm", "nccl")
    assert wire is torch.bfloat16
    for version in (1, 2):
        W.broadcast_weights(ch, me, named, version, bucket_bytes=1 << 20, wire=wire)
    assert len(FakeNCCL.built) == 1                        # created once per member set
    pg = FakeNCCL.built[0]
    assert (pg.rank, pg.size, pg.opts._timeout) == (0, 1, W.GROUP_TIMEOUT)
    flat, root = pg.sent[-1]
    assert root == 0 and len(pg.sent) == 2
    header = W._header(named, 2, wire)
    got = W._unpack(header, flat)
    assert got["a.weight"].dtype == torch.bfloat16 and torch.equal(got["a.weight"], named["a.weight"].bfloat16())
    assert got["step"].dtype == torch.int64 and torch.equal(got["step"], named["step"])   # ints as they are
    assert ch.staging_allocations == 1
    ch.close()
    assert W.wire_dtype("auto", "torch", "mpi") is None and W.wire_dtype("fp16", "vllm", "gloo") is torch.float16


def test_nccl_sync_groups_time_out_with_weight_sync_timeout_s(monkeypatch):
    """weight_sync.timeout_s is the NCCL group's own timeout, and NCCL's async error handling
    is on, so its watchdog ends a collective none of our waits watches."""
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    FakeNCCL.built = []
    world = MPI.COMM_WORLD
    ch = W.SyncChannels(world, "nccl", device="cpu", timeout_s=42)
    W.broadcast_weights(ch, (world.Get_rank(),), {"w": torch.ones(4)}, 1, bucket_bytes=1 << 20)
    assert FakeNCCL.built[0].opts._timeout.total_seconds() == 42
    import os
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    ch.close()
