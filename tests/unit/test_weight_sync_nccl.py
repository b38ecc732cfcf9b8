"""Structural tests of the NCCL branch of the weight stream (the CPU torch build has no
ProcessGroupNCCL): a fake records how groups are built, freed and what is broadcast, on a
one-rank member set; the same code runs over gloo and MPI for real in tests/mpi/."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

from flexmarl_hpc.runtime import weight_sync as W
from flexmarl_hpc.runtime.deadline import CollectiveTimeout


class FakeNCCL:
    built: list["FakeNCCL"] = []
    hang = False                       # broadcasts that never complete (a member gone)

    class Options:
        _timeout = None

    def __init__(self, store, rank, size, opts):
        self.rank, self.size, self.opts, self.sent, self.down = rank, size, opts, [], False
        self.aborted = False
        FakeNCCL.built.append(self)

    def broadcast(self, tensors, opts):
        t = tensors[0]
        self.sent.append((t.device.type, t.numel(), t.clone() if t.device.type == "cpu" else None, opts.rootRank))
        done = not FakeNCCL.hang
        return type("Work", (), {"wait": lambda self: True, "is_completed": lambda self: done})()

    def shutdown(self):
        self.down = True

    def abort(self):
        self.aborted = True


def _sync(ch, ids, named, version, bucket, wire=None):
    me = MPI.COMM_WORLD.Get_rank()
    plan = W.Plan((me,), (W.plan_buckets(W.layout_of(named), bucket, wire),), (ids.use(0, ()),), (ids.live(0),))
    W.send_weights(ch, (), plan, version, 0, named.items(), leader=True)
    return plan


def _fake(monkeypatch):
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    FakeNCCL.built, FakeNCCL.hang = [], False


def test_buckets_live_on_the_device_and_the_sender_holds_two(monkeypatch):
    """`meta` stands in for the GPU: every broadcast bucket must be a device tensor no larger
    than a bucket, and the sender allocates its two buffers once for all syncs."""
    _fake(monkeypatch)
    ch = W.SyncChannels(MPI.COMM_WORLD, "nccl", device="meta")
    named = {f"layer{i}.weight": torch.randn(64, 64) for i in range(8)}     # 8 x 16 KiB
    ids = W.GroupIds()
    for version in (1, 2):
        _sync(ch, ids, named, version, bucket=40 << 10)                    # 2 tensors a bucket
    pg, = FakeNCCL.built                                                  # one group, reused
    assert (pg.rank, pg.size, pg.opts._timeout) == (0, 1, W.GROUP_TIMEOUT)
    assert len(pg.sent) == 8 and all(dev == "meta" and n <= 40 << 10 for dev, n, _, _ in pg.sent)
    assert ch.buffer_allocations == 2 and all(b.device.type == "meta" for b in ch._buffers)
    ch.close()
    assert pg.down                                                        # freed, not left to GC


def test_bf16_wire_and_ints_as_they_are(monkeypatch):
    _fake(monkeypatch)
    ch = W.SyncChannels(MPI.COMM_WORLD, "nccl", device="cpu")
    named = {"a.weight": torch.randn(3, 5), "b.bias": torch.randn(7), "step": torch.tensor([4])}
    wire = W.wire_dtype("auto", "vllm", "nccl")
    assert wire is torch.bfloat16
    plan = _sync(ch, W.GroupIds(), named, 1, bucket=1 << 20, wire=wire)
    (_, _, flat, root), = FakeNCCL.built[0].sent
    got = W.bucket_views(plan.stages[0][0], flat)
    assert root == 0 and got["a.weight"].dtype == torch.bfloat16
    assert torch.equal(got["a.weight"], named["a.weight"].bfloat16())
    assert got["step"].dtype == torch.int64 and torch.equal(got["step"], named["step"])
    ch.close()
    assert W.wire_dtype("auto", "torch", "mpi") is None and W.wire_dtype("fp16", "vllm", "gloo") is torch.float16


def test_nccl_sync_groups_time_out_with_weight_sync_timeout_s(monkeypatch):
    """weight_sync.timeout_s is the NCCL group's own timeout, and NCCL's async error handling
    is on, so its watchdog ends a collective none of our waits watches."""
    _fake(monkeypatch)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    ch = W.SyncChannels(MPI.COMM_WORLD, "nccl", device="cpu", timeout_s=42)
    _sync(ch, W.GroupIds(), {"w": torch.ones(4)}, 1, bucket=1 << 20)
    assert FakeNCCL.built[0].opts._timeout.total_seconds() == 42
    import os
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    ch.close()


def test_a_bucket_that_never_completes_times_out_and_aborts_its_group(monkeypatch):
    """Each bucket's Work is waited for by the sync's deadline (is_completed polls), not a
    blocking wait(); at it the sender raises CollectiveTimeout having run the rest of the
    stream (a megatron sender's TP gathers), its data group is aborted and the communicator
    forgotten, and dropped ids give the set a new group (a new store prefix) next time."""
    _fake(monkeypatch)
    FakeNCCL.hang = True
    ch = W.SyncChannels(MPI.COMM_WORLD, "nccl", device="cpu", timeout_s=0.3)
    me = MPI.COMM_WORLD.Get_rank()
    named = {f"l{i}": torch.ones(256) for i in range(4)}                   # 4 buckets of 1 KiB
    streamed = []
    ids = W.GroupIds()
    plan = W.Plan((me,), (W.plan_buckets(W.layout_of(named), 1024),), (ids.use(0, ()),), (ids.live(0),))
    with pytest.raises(CollectiveTimeout, match="a bucket"):
        W.send_weights(ch, (), plan, 1, 0, ((k, streamed.append(k) or t) for k, t in named.items()), leader=True)
    assert streamed == list(named)                                         # the stream ran to its end
    pg, = FakeNCCL.built
    assert pg.aborted and not ch.groups and (me,) not in ch.cache and (me,) not in ch.layouts
    ids.drop(())
    assert ids.use(0, ()) != plan.gids[0]
    ch.close()


def test_groups_are_bounded_least_recently_used_closed(monkeypatch):
    """A trainer keeps at most `cap` data groups; the plan's live ids make every member close
    the others, and a set seen again gets a fresh group (a new id, a new store prefix)."""
    _fake(monkeypatch)
    ids = W.GroupIds(cap=2)
    a, b, c = ids.use(0, (5,)), ids.use(0, (6,)), ids.use(0, (5,))
    assert a == c and ids.use(0, (7,)) == 3 and ids.live(0) == (1, 3)     # (6,) closed
    assert ids.use(0, (6,)) == 4 and ids.live(0) == (3, 4)                # (5,) closed, (6,) anew
    ch = W.SyncChannels(MPI.COMM_WORLD, "nccl", device="cpu")
    me = MPI.COMM_WORLD.Get_rank()
    ids = W.GroupIds(cap=1)
    for v in range(3):
        ch.group((me,), ids.use(0, (v,)))
        ch.forget(me, ids.live(0))
    assert len(ch.groups) == 1 and [pg.down for pg in FakeNCCL.built] == [True, True, False]
    ch.close()
