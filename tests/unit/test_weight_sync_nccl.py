"""Structural tests of the NCCL branch of the weight stream (the CPU torch build has no
ProcessGroupNCCL): a fake records how the pair's group is built and freed and what is sent
point to point, from this rank (a stage sender) to the first link of a chain; the same code
runs over gloo and MPI for real in tests/mpi/."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

from flexmarl_hpc.runtime import sync_channels as G
from flexmarl_hpc.runtime import weight_sync as W
from flexmarl_hpc.runtime.deadline import CollectiveTimeout

TARGET = 1                            # a replica's world rank (the chain's next link)


class FakeNCCL:
    built: list["FakeNCCL"] = []
    hang = False                       # sends that never complete (a member gone)

    class Options:
        _timeout = None

    def __init__(self, store, rank, size, opts):
        self.rank, self.size, self.opts, self.sent, self.down = rank, size, opts, [], False
        self.aborted, self.bound = False, None
        FakeNCCL.built.append(self)

    def eager_connect_single_device(self, device):
        self.bound = device

    def send(self, tensors, dst, tag):
        t = tensors[0]
        self.sent.append((t.device.type, t.numel(), t.clone() if t.device.type == "cpu" else None, dst))
        done = not FakeNCCL.hang
        return type("Work", (), {"wait": lambda self: True, "is_completed": lambda self: done})()

    def shutdown(self):
        self.down = True

    def abort(self):
        self.aborted = True


def _fake(monkeypatch):
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    FakeNCCL.built, FakeNCCL.hang = [], False


def _channels(**kw) -> G.SyncChannels:
    """Channels holding one pair: this rank the sender, TARGET the replica (as open makes it)."""
    ch = W.SyncChannels(MPI.COMM_WORLD, "nccl", **kw)
    me = MPI.COMM_WORLD.Get_rank()
    pair = G.Pair((0, 0), (me,), (TARGET,), MPI.COMM_SELF, first={me: 0, TARGET: 1}, count={me: 1, TARGET: 1})
    pair.pg = G.new_group("nccl", dist.HashStore(), 0, 2, ch.group_timeout, ch.device)
    ch.pairs[pair.key] = pair
    return ch


def _sync(ch, named, version, bucket, wire=None):
    plan = W.SyncPlan((MPI.COMM_WORLD.Get_rank(),), (W.plan_buckets(W.layout_of(named), bucket, wire),))
    W.send_weights(ch, (TARGET,), plan, version, 0, named.items(), leader=False)
    return plan


def test_buckets_live_on_the_device_and_the_sender_holds_two(monkeypatch):
    """`meta` stands in for the GPU: every bucket sent must be a device tensor no larger than
    a bucket, to the chain's first link, and the sender allocates its two buffers once."""
    _fake(monkeypatch)
    ch = _channels(device="meta")
    named = {f"layer{i}.weight": torch.randn(64, 64) for i in range(8)}     # 8 x 16 KiB
    for version in (1, 2):
        _sync(ch, named, version, bucket=40 << 10)                          # 2 tensors a bucket
    pg, = FakeNCCL.built                                                  # the pair's group, reused
    assert (pg.rank, pg.size, pg.opts._timeout) == (0, 2, W.GROUP_TIMEOUT)
    assert len(pg.sent) == 8 and all(dev == "meta" and n <= 40 << 10 and dst == 1 for dev, n, _, dst in pg.sent)
    assert ch.buffer_allocations == 2 and all(b.device.type == "meta" for b in ch._buffers)
    ch.close()
    assert pg.down                                                        # freed, not left to GC


def test_nccl_groups_are_bound_to_the_device_at_creation(monkeypatch):
    """On a GPU the pair's NCCL communicator is made eagerly on the rank's device, so the
    chain's send/recv run on it rather than on a 2-rank communicator per peer."""
    _fake(monkeypatch)
    pg = G.new_group("nccl", dist.HashStore(), 0, 3, device=torch.device("cuda", 1))
    assert pg.bound == torch.device("cuda", 1)
    assert G.new_group("nccl", dist.HashStore(), 0, 3, device=torch.device("cpu")).bound is None


def test_bf16_wire_and_ints_as_they_are(monkeypatch):
    _fake(monkeypatch)
    ch = _channels(device="cpu")
    named = {"a.weight": torch.randn(3, 5), "b.bias": torch.randn(7), "step": torch.tensor([4])}
    wire = W.wire_dtype("auto", "vllm", "nccl")
    assert wire is torch.bfloat16
    plan = _sync(ch, named, 1, bucket=1 << 20, wire=wire)
    (_, _, flat, dst), = FakeNCCL.built[0].sent
    got = W.bucket_views(plan.stages[0][0], flat)
    assert dst == 1 and got["a.weight"].dtype == torch.bfloat16
    assert torch.equal(got["a.weight"], named["a.weight"].bfloat16())
    assert got["step"].dtype == torch.int64 and torch.equal(got["step"], named["step"])
    ch.close()
    assert W.wire_dtype("auto", "torch", "mpi") is None and W.wire_dtype("fp16", "vllm", "gloo") is torch.float16


def test_nccl_sync_groups_time_out_with_weight_sync_timeout_s(monkeypatch):
    """weight_sync.timeout_s is the NCCL group's own timeout, and NCCL's async error handling
    is on, so its watchdog ends a transfer none of our waits watches."""
    _fake(monkeypatch)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    ch = _channels(device="cpu", timeout_s=42)
    _sync(ch, {"w": torch.ones(4)}, 1, bucket=1 << 20)
    assert FakeNCCL.built[0].opts._timeout.total_seconds() == 42
    import os
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    ch.close()


def test_a_bucket_that_never_completes_times_out_and_abandons_its_pair(monkeypatch):
    """Each bucket's Work is waited for by the sync's deadline (is_completed polls), not a
    blocking wait(); at it the sender raises CollectiveTimeout having run the rest of the
    stream (a megatron sender's TP gathers), the pair's group is aborted, and a later sync
    over the pair is refused by name (no new group is made for it)."""
    _fake(monkeypatch)
    FakeNCCL.hang = True
    ch = _channels(device="cpu", timeout_s=0.3)
    named = {f"l{i}": torch.ones(256) for i in range(4)}                   # 4 buckets of 1 KiB
    streamed = []
    plan = W.SyncPlan((MPI.COMM_WORLD.Get_rank(),), (W.plan_buckets(W.layout_of(named), 1024),))
    with pytest.raises(CollectiveTimeout, match="a bucket"):
        W.send_weights(ch, (TARGET,), plan, 1, 0, ((k, streamed.append(k) or t) for k, t in named.items()),
                       leader=False)
    assert streamed == list(named)                                         # the stream ran to its end
    pg, = FakeNCCL.built
    assert pg.aborted and ch.pairs[0, 0].dead
    FakeNCCL.hang = False
    with pytest.raises(RuntimeError, match="abandoned"):
        _sync(ch, named, 2, bucket=1024)
    assert len(FakeNCCL.built) == 1
    ch.close()


@pytest.mark.parametrize("borrow", [False, True])
def test_a_stream_filling_in_place_runs_to_its_end_past_a_timeout(monkeypatch, borrow):
    """A megatron sender's stream assembles in the buckets (weight_sync.Destination); past the
    deadline (at a bucket's wait, or while a column block borrows the other buffer: `borrow`)
    the rest of it still runs, into throwaway tensors, so its TP sends meet their receives."""
    _fake(monkeypatch)
    FakeNCCL.hang = True
    ch = _channels(device="cpu", timeout_s=0.3)
    named = {f"l{i}": torch.ones(256) for i in range(4)}                   # 4 buckets of 1 KiB
    plan = W.SyncPlan((MPI.COMM_WORLD.Get_rank(),), (W.plan_buckets(W.layout_of(named), 1024),))
    dest, streamed = W.Destination(plan), []

    def stream():
        for k, t in named.items():
            rows = dest.rows(k, tuple(t.shape), t)
            if borrow and k == "l1":
                dest.scratch(512, t)            # waits for l0's send, which never completes
            rows.copy_(t)
            streamed.append(k)
            yield k, rows
    with pytest.raises(CollectiveTimeout, match="a bucket"):
        W.send_weights(ch, (TARGET,), plan, 1, 0, stream(), leader=False, dest=dest)
    assert streamed == list(named)
    FakeNCCL.hang = False
    ch.close()
