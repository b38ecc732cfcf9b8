"""Tensors larger than a bucket: the plan cuts them into pieces of whole rows, the sender's
two buffers stay within two buckets (runtime/memtrack), and a receiver that lands each piece
in place (`landing`) gets every tensor whole and bit-equal (`received`). One rank, a
recording group standing in for the pair's group (its sends to the chain's first link); the same code over gloo and MPI between
ranks in tests/mpi/test_weight_sync.py, into vLLM's workers in test_vllm_engines.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

from flexmarl_hpc.runtime import sync_channels as G
from flexmarl_hpc.runtime import weight_sync as W
from flexmarl_hpc.runtime.memtrack import TensorBytes


def test_a_tensor_larger_than_a_bucket_goes_in_row_pieces_each_a_bucket():
    layout = [("a", (3,), torch.float32), ("embed", (30, 8), torch.float32), ("b", (2, 4), torch.float32)]
    buckets = W.plan_buckets(layout, 320)                 # embed: 960 B, 32 B a row -> 10 rows a piece
    assert [(b.names, b.piece) for b in buckets] == [
        (("a",), None), (("embed",), W.Piece(0, 10, 30)), (("embed",), W.Piece(10, 20, 30)),
        (("embed",), W.Piece(20, 30, 30)), (("b",), None)]
    assert all(b.total <= 320 for b in buckets)
    embed = buckets[1:4]
    assert [b.at for b in embed] == [0, 320, 640] and {b.span for b in embed} == {960}
    assert [b.complete for b in embed] == [False, False, True]
    assert max(b.total for b in buckets) == 320 and W.SyncPlan((0,), (buckets,)).span == 960
    # the wire dtype decides the bytes: bf16 rows are 16 B, the tensor (480 B) 2 pieces
    half = W.plan_buckets(layout, 320, torch.bfloat16)
    assert [b.piece for b in half if b.piece] == [W.Piece(0, 20, 30), W.Piece(20, 30, 30)]
    # a tensor that fits a bucket is never cut, however full the current one
    assert all(b.piece is None for b in W.plan_buckets(layout, 960))


def test_a_bucket_smaller_than_a_row_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"weight_sync.bucket_mb: a bucket of 16 B cannot hold one row of embed"):
        W.plan_buckets([("embed", (30, 8), torch.float32)], 16)


class Recorder:
    """A pair's group that keeps a copy of every bucket sent (numpy: not a torch
    allocation, so the sender's tensor bytes are its own)."""
    built: list["Recorder"] = []

    class Options:
        _timeout = None

    def __init__(self, store, rank, size, opts):
        self.sent = []
        Recorder.built.append(self)

    def send(self, tensors, dst, tag):
        self.sent.append(tensors[0].numpy().copy())
        return type("Work", (), {"wait": lambda self: True, "is_completed": lambda self: True})()


def _nccl_channels_to_one_replica() -> tuple:
    """SyncChannels with one recorded-NCCL pair from this rank to replica rank 1, and this
    rank (the sender)."""
    ch = W.SyncChannels(MPI.COMM_WORLD, "nccl", device="cpu")
    me = MPI.COMM_WORLD.Get_rank()
    pair = G.Pair((0, 0), (me,), (1,), MPI.COMM_SELF, G.new_group("nccl", dist.HashStore(), 0, 2),
                  {me: 0, 1: 1}, {me: 1, 1: 1})
    ch.pairs[pair.key] = pair
    return ch, me


@pytest.mark.parametrize("wire", [None, torch.bfloat16])
def test_split_tensors_arrive_whole_and_bit_equal_with_the_sender_within_two_buckets(monkeypatch, wire):
    Recorder.built = []
    monkeypatch.setattr(dist, "ProcessGroupNCCL", Recorder, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    g = torch.Generator().manual_seed(0)
    named = {"embed": torch.randn(30, 8, generator=g), "norm": torch.randn(8, generator=g),
             "head": torch.randn(8, 30, generator=g).T,          # non-contiguous: rows are views
             "mlp": torch.randn(12, 8, generator=g), "step": torch.tensor([4, 5])}
    bucket = 30 * 8 * 4 // 3                                      # a third of the largest tensor
    ch, me = _nccl_channels_to_one_replica()
    plan = W.SyncPlan((me,), (W.plan_buckets(W.layout_of(named), bucket, wire),))
    assert sum(b.piece is not None for b in plan.stages[0]) >= 4           # embed and head
    with TensorBytes() as mem:
        W.send_weights(ch, (1,), plan, 1, 0, named.items(), leader=False)
    assert 0 < mem.peak <= 2 * bucket, (mem.peak, bucket)        # not 2 x the 960 B tensor
    sent, = [r.sent for r in Recorder.built]
    assert len(sent) == len(plan.stages[0]) and all(s.size <= bucket for s in sent)
    buf, got = torch.zeros(plan.span, dtype=torch.uint8), {}     # the receiver's one buffer
    for b, data in zip(plan.stages[0], sent):
        W.landing(b, buf).copy_(torch.from_numpy(data))
        whole = W.received(b, buf)
        assert bool(whole) == b.complete
        got.update({k: v.clone() for k, v in whole.items()})
    assert sorted(got) == sorted(named)
    for k, v in named.items():
        want = v.to(wire) if wire is not None and v.is_floating_point() else v
        assert got[k].dtype == want.dtype and torch.equal(got[k], want), k
    ch.close()


def test_a_stream_that_differs_from_a_split_plan_is_named():
    named = {"embed": torch.ones(30, 8)}
    buckets = W.plan_buckets(W.layout_of(named), 320)
    flat = torch.empty(320, dtype=torch.uint8)
    held = W.fill_bucket(buckets[0], flat, iter(named.items()))
    assert held[0] == "embed" and held[1] is named["embed"]             # held, not copied
    with pytest.raises(RuntimeError, match="streamed 'other' where the plan has 'embed'"):
        W.fill_bucket(buckets[0], flat, iter([("other", torch.ones(30, 8))]))
    assert np.array_equal(flat[:4].numpy(), torch.ones(1).view(torch.uint8).numpy())


def test_a_stream_of_row_pieces_fills_the_buckets_a_whole_stream_does():
    """A sharded trainer streams a split tensor as the plan's row ranges (`row_pieces`), one
    at a time, instead of whole: the buckets carry the same bytes either way, a piece is never
    held past its bucket, and rows that are neither the piece's nor the whole tensor's are
    named."""
    g = torch.Generator().manual_seed(0)
    named = {"embed": torch.randn(30, 8, generator=g), "norm": torch.randn(8, generator=g),
             "head": torch.randn(8, 30, generator=g).T, "mlp": torch.randn(12, 8, generator=g)}
    buckets = W.plan_buckets(W.layout_of(named), 30 * 8 * 4 // 3)
    pieces = W.row_pieces(W.SyncPlan((0,), (buckets,)))
    assert set(pieces) == {"embed", "head", "mlp"} and pieces["embed"][0][0] == 0 and pieces["embed"][-1][1] == 30

    def fill(stream):
        out, it, held = [], iter(stream), None
        for b in buckets:
            flat = torch.zeros(b.total, dtype=torch.uint8)
            held = W.fill_bucket(b, flat, it, held)
            out.append(flat)
        assert held is None and next(it, None) is None
        return out
    piecewise = [(k, v[a:b].clone()) for k, v in named.items() for a, b in pieces.get(k, [(0, len(v))])]
    assert len(piecewise) == len(buckets)                              # a piece or norm a bucket
    assert all(torch.equal(x, y) for x, y in zip(fill(piecewise), fill(named.items())))
    first = next(b for b in buckets if b.piece is not None)
    with pytest.raises(RuntimeError, match=r"streamed 3 rows of 'embed' where the plan has its rows \[0, 10\)"):
        W.fill_bucket(first, torch.zeros(first.total, dtype=torch.uint8), iter([("embed", named["embed"][:3])]))


def _in_place(named, pieces, dest):
    """A sharded trainer's stream with a Destination (megatron `sync_stream`): each split
    tensor's row ranges assembled in the bucket being filled (`dest.rows`, cast on copy)."""
    for k, v in named.items():
        for a, b in pieces.get(k, [(0, len(v))]):
            rows = dest.rows(k, (b - a, *v.shape[1:]), v)
            rows.copy_(v[a:b])
            yield k, rows
            del rows


@pytest.mark.parametrize("wire", [None, torch.bfloat16])
def test_a_stream_assembled_in_place_adds_nothing_beside_the_two_buffers(monkeypatch, wire):
    """The sender's extra memory is its two bucket buffers (issue 28): ranges assembled in
    place through a Destination, bit-equal on landing; the same ranges as new tensors (the
    Allocate default, what megatron's stream did before 2026-11-26) exceed 2 buckets."""
    Recorder.built = []
    monkeypatch.setattr(dist, "ProcessGroupNCCL", Recorder, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    g = torch.Generator().manual_seed(1)
    named = {"embed": torch.randn(30, 8, generator=g), "norm": torch.randn(8, generator=g),
             "head": torch.randn(8, 30, generator=g).T, "mlp": torch.randn(12, 8, generator=g)}
    bucket = 30 * 8 * 4 // 3
    ch, me = _nccl_channels_to_one_replica()
    plan = W.SyncPlan((me,), (W.plan_buckets(W.layout_of(named), bucket, wire),))
    pieces = W.row_pieces(plan)
    peaks = []
    for dest in (W.Destination(plan), W.Allocate()):
        kept = sum(b.numel() for b in ch._buffers if b is not None)     # the buffers a sync keeps
        with TensorBytes() as mem:
            W.send_weights(ch, (1,), plan, 1, 0, _in_place(named, pieces, dest), leader=False,
                           dest=dest if isinstance(dest, W.Destination) else None)
        peaks.append(kept + mem.peak)
    largest = max(b.total for b in plan.stages[0])
    assert peaks[0] == 2 * largest and peaks[1] > 2 * bucket, (peaks, largest, bucket)
    sent, = [r.sent for r in Recorder.built]
    buf, got = torch.zeros(plan.span, dtype=torch.uint8), {}
    for b, data in zip(plan.stages[0], sent[:len(plan.stages[0])]):     # the in-place sync's
        W.landing(b, buf).copy_(torch.from_numpy(data))
        got.update({k: v.clone() for k, v in W.received(b, buf).items()})
    for k, v in named.items():
        assert torch.equal(got[k], v if wire is None else v.to(wire)), k
    ch.close()


def test_a_column_block_borrows_the_other_buffer_once_its_send_is_out():
    """`Destination.scratch` (a column block's receive buffer) is the other bucket buffer,
    handed out only after that buffer's send is waited for; buckets without a column block
    keep the overlap (no wait on the other buffer while they fill)."""
    layout = [(k, (16,), torch.float32) for k in "abc"]
    buckets = W.plan_buckets(layout, 64)
    assert len(buckets) == 3
    plan = W.SyncPlan((0,), (buckets,))
    dest, events = W.Destination(plan), []
    buffers = [torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)]
    x = torch.arange(16, dtype=torch.float32)

    def stream():
        for k in "abc":
            rows = dest.rows(k, (16,), x)
            if k == "b":
                events.append(("scratch", dest.scratch(32, x).data_ptr()))
            rows.copy_(x)
            yield k, rows
    W.fill_stage(buckets, iter(stream()), dest, buffers.__getitem__,
                 lambda slot, flat: events.append(("send", slot)), lambda slot: events.append(("wait", slot)))
    assert events == [("wait", 0), ("send", 0),
                      ("wait", 1), ("wait", 0), ("scratch", buffers[0].data_ptr()), ("send", 1),
                      ("wait", 0), ("send", 0), ("wait", 0), ("wait", 1)]
    assert torch.equal(buffers[1].view(torch.float32), x)
    with pytest.raises(RuntimeError, match=r"assembles 'zz' \[4\] where the bucket being filled has \['c'\]"):
        dest.rows("zz", (4,), x)
    with pytest.raises(RuntimeError, match="a column block of 128 B exceeds the other bucket buffer"):
        dest.spare = lambda: buffers[0]
        dest.scratch(128, x)


def test_a_timeout_while_borrowing_the_other_buffer_leaves_the_stream_running():
    """The other buffer's send timing out inside `scratch` (inside the trainer's stream) must
    not end the stream: its TP sends are the group's collectives, which send_weights drains
    after a CollectiveTimeout. The timeout comes out of fill_stage after the bucket, and the
    rest of the stream lands in throwaway tensors (`draining`), not in the bucket buffers."""
    from flexmarl_hpc.runtime.deadline import CollectiveTimeout
    buckets = W.plan_buckets([(k, (16,), torch.float32) for k in "abcd"], 64)
    dest, seen, waits = W.Destination(W.SyncPlan((0,), (buckets,))), [], []
    buffers = [torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)]
    x = torch.arange(16, dtype=torch.float32)

    def wait(slot):
        waits.append(slot)
        if len(waits) == 3:                  # bucket b borrowing buffer 0: its send hangs
            raise CollectiveTimeout("weight sync over ranks [0, 1]", "a bucket", 1.0, 1.0)

    def stream():
        for k in "abcd":
            rows = dest.rows(k, (16,), x)
            seen.append((k, any(rows.data_ptr() == b.data_ptr() for b in buffers)))
            if k in "bc":
                dest.scratch(32, x)
            rows.copy_(x)
            yield k, rows
    it = iter(stream())
    with pytest.raises(CollectiveTimeout, match="a bucket"):
        W.fill_stage(buckets, it, dest, buffers.__getitem__, lambda slot, flat: None, wait)
    dest.draining = True                     # as send_weights does before it drains
    assert [k for k, _ in it] == ["c", "d"]
    assert seen == [("a", True), ("b", True), ("c", False), ("d", False)]
