"""Weight streaming from a trainer group's pipeline stages to the replicas serving an agent.

Weights leave a trainer only when the orchestrator asks for a sync. The trainer streams its
HF-named tensors one at a time (megatron: each tensor, or each piece's rows of one larger
than a bucket, assembled in HF layout on the device from the TP shards holding those rows,
trainer/megatron/trainer.py `sync_stream`), each PP stage
from its own sender (its TP rank 0 of data-parallel replica 0), and the sender packs them
into fixed-size buckets (`weight_sync.bucket_mb`) sent to the target replicas. A tensor
larger than a bucket (a 152k-row embedding or LM head) goes as pieces of whole rows, a
bucket each (`Piece`), so the sender's two bucket buffers (one in flight while the next
fills) never exceed two buckets, whatever the model, and a sharded trainer gathers one
piece's rows at a time (`row_pieces`), never the whole tensor, straight into the bucket being
filled (`Destination`): the sender's extra memory is its two bucket buffers. A receiver has one buffer, of a bucket
or of the largest split tensor: each piece lands in place at its offset in that tensor
(`landing`), which goes to the engine whole after its last piece (`received`; engines load
whole tensors: vLLM's weight loaders shard a full tensor per TP rank). Receivers hand each
bucket to the engine before the next arrives (`RolloutEngine.load_weights` takes the
buckets as an iterable), and mark the new version only after the last, so nothing samples
with half-updated weights.

Every transfer runs inside the sync group of its (trainer group, pool), made at start
(runtime/sync_channels.py, config/sync_groups.py), whatever subset of the pool it targets:

- the plan (`SyncPlan`: per stage, its sender and buckets of names, dtypes, shapes, offsets; a
  pure function of the model, TP/PP and the bucket size) goes from the group leader to each
  target point to point over the pair's MPI communicator, after every target has announced
  itself (the rendezvous: waited for without spinning, comm.py); a target that already got
  this plan from this leader gets 24 bytes instead;
- each bucket travels along a chain, stage sender -> target 1 -> target 2 ... (`chain`; a
  vLLM replica's TP workers are consecutive links), point to point: each target forwards
  a bucket as soon as it has landed, while its engine loads it. Replicas outside the sync
  take no part. Backend `mpi`: `Issend`/`Irecv` on the pair's communicator (a synchronous
  send: it completes only once the next link has posted its receive, so a link that never
  comes is seen at the deadline); `gloo` / `nccl`: `send`/`recv` on the pair's
  torch.distributed group (`ProcessGroupGloo` / `ProcessGroupNCCL`; on GPUs the production
  path, buckets on the device, NCCL GPU to GPU; on CPU the same code over gloo).

Every wait of a sync has one deadline, `weight_sync.timeout_s` from its start on that rank
(runtime/deadline.py; receivers `receiver_grace` longer, so a live sender gives up first):
the rendezvous and each bucket's send and receive (MPI requests waited with `Test` and
back-off sleeps, torch `Work`s by `deadline.wait_works`). Past it the rank raises
CollectiveTimeout and abandons the pairs the sync used (a transfer stays pending in them;
torch groups are aborted; a later sync over them is refused by name); its worker reports it
(messages.SyncTimedOut). NCCL and gloo groups get it as their own timeout too, with
TORCH_NCCL_ASYNC_ERROR_HANDLING set, so NCCL's watchdog ends what no wait of ours watches.
A vLLM replica's TP workers (RemoteGroup) receive in their own processes: each bucket's
header carries the seconds left and the chain, and the worker waits its transfers by then.
The orchestrator issues syncs in one global order, so every member meets the transfers in
the same sequence and concurrent syncs cannot deadlock.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from flexmarl_hpc.runtime import deadline
from flexmarl_hpc.runtime.deadline import CollectiveTimeout, Deadline
from flexmarl_hpc.runtime.sync_channels import (CPU_DEFAULT, GROUP_TIMEOUT, Pair, RemoteGroup,  # noqa: F401
                                              SyncChannels, _shutdown, host_bytes, new_group,
                                              resolve_backend)

MPI_CHUNK = 1 << 30
TAG_DATA, TAG_PLAN = 21, 22             # on a pair's MPI communicator

@dataclass(frozen=True)
class Piece:
    """Rows [first, stop) of a tensor of `rows` rows (its dim 0) larger than a bucket: such a
    tensor travels as consecutive pieces in row order, each a bucket of its own, so no
    sender buffer exceeds a bucket. A receiver lands each piece at its byte offset in one
    buffer of the whole tensor and hands the tensor over after the last (`received`)."""
    first: int
    stop: int
    rows: int


@dataclass(frozen=True)
class Bucket:
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]   # whole tensors' shapes (a piece's too)
    nbytes: tuple[int, ...]               # bytes this bucket carries of each
    offsets: tuple[int, ...]           # 16-byte aligned, so every dtype can be viewed in place
    total: int
    piece: Piece | None = None         # set: the bucket is rows of its one tensor

    @property
    def at(self) -> int:
        """Byte offset of this bucket in the receiver's buffer (a piece's in its tensor)."""
        p = self.piece
        return 0 if p is None else p.first * (self.nbytes[0] // (p.stop - p.first))

    @property
    def span(self) -> int:
        """Bytes of receiver buffer this bucket needs: a piece's whole tensor."""
        p = self.piece
        return self.total if p is None else p.rows * (self.nbytes[0] // (p.stop - p.first))

    @property
    def complete(self) -> bool:
        """Whether every tensor it names is whole once it is in (a piece: the last one)."""
        return self.piece is None or self.piece.stop == self.piece.rows


@dataclass(frozen=True)
class SyncPlan:
    """What one sync carries, per PP stage: its sender (world rank) and its buckets."""
    senders: tuple[int, ...]
    stages: tuple[tuple[Bucket, ...], ...]

    @property
    def largest(self) -> int:
        """The largest bucket: a sender buffer's size (at most weight_sync.bucket_mb)."""
        return max((b.total for st in self.stages for b in st), default=0)

    @property
    def span(self) -> int:
        """A receiver buffer's size: the largest bucket or tensor sent in pieces."""
        return max((b.span for st in self.stages for b in st), default=0)


Layout = list[tuple[str, tuple[int, ...], torch.dtype]]     # (HF name, shape, dtype) in stream order


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def plan_buckets(layout: Layout, bucket_bytes: int, wire: torch.dtype | None = None) -> tuple[Bucket, ...]:
    """Greedy packing of a stage's tensors, in stream order, into buckets of at most
    `bucket_bytes`; a larger tensor goes as pieces of whole rows, a bucket each (`Piece`).
    `wire`: the dtype floating tensors travel in (None: theirs)."""
    buckets, cur = [], []
    used = 0
    for name, shape, dt in layout:
        dt = wire if wire is not None and dt.is_floating_point else dt
        nb = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        padded = -(-nb // 16) * 16
        if cur and used + padded > bucket_bytes:
            buckets.append(_bucket(cur))
            cur, used = [], 0
        if nb > bucket_bytes and len(shape) > 0:
            buckets += _pieces(name, tuple(shape), dt, nb, bucket_bytes)
            continue
        cur.append((name, dt, tuple(shape), nb, used))
        used += padded
    if cur:
        buckets.append(_bucket(cur))
    return tuple(buckets)


def _pieces(name: str, shape: tuple[int, ...], dt: torch.dtype, nb: int, bucket_bytes: int) -> list[Bucket]:
    """Tensor `name` as pieces of as many whole rows as a bucket holds (the last: the rest).
    Rows, not flat bytes: a row range of a non-contiguous tensor is a view (no copy)."""
    row = nb // shape[0]
    if row > bucket_bytes:
        raise ValueError(f"weight_sync.bucket_mb: a bucket of {bucket_bytes} B cannot hold one row of "
                         f"{name} {list(shape)} ({row} B); expected a bucket of at least one row")
    per = bucket_bytes // row
    return [Bucket((name,), (_dtype_name(dt),), (shape,), ((stop - first) * row,), (0,), (stop - first) * row,
                   Piece(first, stop, shape[0]))
            for first in range(0, shape[0], per) for stop in [min(first + per, shape[0])]]


def _bucket(items) -> Bucket:
    names, dts, shapes, nbs, offs = zip(*items)
    total = offs[-1] + -(-nbs[-1] // 16) * 16
    return Bucket(names, tuple(_dtype_name(d) for d in dts), shapes, nbs, offs, total)


def layout_of(named: dict[str, torch.Tensor]) -> Layout:
    return [(k, tuple(v.shape), v.dtype) for k, v in named.items()]


def dict_bucket(named: dict[str, torch.Tensor], wire: torch.dtype | None = None) -> Bucket:
    """One bucket laid out for all of `named` (state transfer, the torch trainer's buffer)."""
    return plan_buckets(layout_of(named), 1 << 62, wire)[0] if named else Bucket((), (), (), (), (), 0)


def pack(named: dict[str, torch.Tensor], bucket: Bucket, flat: torch.Tensor | np.ndarray) -> None:
    views = bucket_views(bucket, torch.as_tensor(flat))       # a numpy buffer is shared, not copied
    for k in bucket.names:
        views[k].copy_(named[k].detach())


def bucket_views(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The bucket's tensors (a piece: its rows) as views into its bytes (no copy: valid
    until the buffer is reused)."""
    flat = torch.as_tensor(flat)
    p = bucket.piece
    return {name: flat[off:off + nb].view(getattr(torch, dt)).reshape(
                shape if p is None else (p.stop - p.first,) + tuple(shape[1:]))
            for name, dt, shape, nb, off in zip(bucket.names, bucket.dtypes, bucket.shapes,
                                                bucket.nbytes, bucket.offsets)}


def landing(bucket: Bucket, buf: torch.Tensor) -> torch.Tensor:
    """Where a receiver's buffer (at least `bucket.span` bytes) takes the bucket's bytes: a
    piece lands in place, at its offset in its tensor, so the tensor is never copied."""
    return buf[bucket.at:bucket.at + bucket.total]


def received(bucket: Bucket, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """The whole tensors a receiver holds in `buf` once `bucket` has landed (`landing`): the
    bucket's, a split tensor's after its last piece, nothing after another piece. Views,
    valid until the buffer is reused."""
    if not bucket.complete:
        return {}
    if bucket.piece is None:
        return bucket_views(bucket, buf[:bucket.total])
    (name,), (dt,), (shape,) = bucket.names, bucket.dtypes, bucket.shapes
    return {name: buf[:bucket.span].view(getattr(torch, dt)).reshape(shape)}


def fill_bucket(bucket: Bucket, flat: torch.Tensor, it: Iterator[tuple[str, torch.Tensor]],
                held: tuple[str, torch.Tensor] | None = None, dest: "Destination | None" = None
                ) -> tuple[str, torch.Tensor] | None:
    """Copy the bucket's tensors from the trainer's stream `it` into `flat`, cast to the
    wire dtype. A split tensor comes either as its pieces, one per bucket (a sharded trainer
    gathers only those rows: `row_pieces`), or whole at its first piece and `held` (a
    reference, never a copy) until its last: returns what is held for the next bucket.
    `dest`: the stream's Destination; it is pointed at this bucket's views before the stream
    is drawn, and a tensor the stream assembled in place there (`Destination.rows`) is not
    copied again."""
    views = bucket_views(bucket, flat)
    if dest is not None:
        dest.views = views
    p = bucket.piece
    for name in bucket.names:
        got, t = held or next(it)
        if got != name:
            raise RuntimeError(f"weight sync: the trainer streamed {got!r} where the plan has {name!r}")
        if p is not None and t.shape[0] not in (p.rows, p.stop - p.first):
            raise RuntimeError(f"weight sync: the trainer streamed {t.shape[0]} rows of {name!r} where the plan "
                               f"has its rows [{p.first}, {p.stop}) of {p.rows}; expected all or those")
        if p is not None and t.shape[0] == p.stop - p.first:      # the piece itself (p.rows never is)
            held = None
        else:
            held = (got, t) if not bucket.complete else None
            t = t if p is None else t[p.first:p.stop]
        if t is not views[name]:                # else: assembled in place by the stream
            views[name].copy_(t)
        del t                           # the stream's next tensor must not meet this one
    return held


class Allocate:
    """Where a trainer's `sync_stream` assembles a row range when no bucket waits for it
    (tests, export): a new tensor per range and a new receive buffer per column block, in the
    parameter's own dtype."""

    def dtype(self, name: str, own: torch.dtype) -> torch.dtype:
        """The dtype every TP rank sends its rows of HF tensor `name` in."""
        return own

    def rows(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """Where the sender assembles rows `shape` of `name` (on `like`'s device)."""
        return like.new_empty(shape, dtype=self.dtype(name, like.dtype))

    def scratch(self, nbytes: int, like: torch.Tensor) -> torch.Tensor:
        """A contiguous byte buffer for one TP rank's column block (p2p needs contiguous)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=like.device)


class Destination(Allocate):
    """The stage sender's bucket buffers as its stream's destination, so that the sender's
    extra memory during a sync is its two bucket buffers and nothing else (issue 28):

    - `rows`: a row range lands in place, in the bucket being filled (`fill_bucket` points
      `views` at it), at the wire dtype: the TP ranks' whole rows are received straight
      into it, the sender's own copied (cast on copy), so no range-sized tensor exists;
    - `dtype`: every TP rank casts its rows to the plan's (wire) dtype before sending, so a
      received range never needs a converted copy on the sender (the cast is on the rank
      that sends, which holds no bucket buffers);
    - `scratch`: a column block (o_proj, down_proj: each TP rank holds columns of the same
      rows) cannot land in place (a strided slice; p2p needs contiguous tensors): it is
      received into the OTHER bucket buffer, after that buffer's send is out (`spare`, set
      by `fill_stage`). Only such ranges lose the overlap of fill and send; a block is at most
      a bucket (its range's bytes / TP in the wire dtype), so it always fits.

    Made from the plan on every rank of the group (the ranks that only send their rows need
    `dtype`); `rows` and `scratch` run on the stage's sender only. `draining`: after a
    CollectiveTimeout the rest of the stream still runs (its TP sends are the group's
    collectives) into throwaway tensors (Allocate's), as send_weights drains it."""

    def __init__(self, plan: SyncPlan):
        self.dtypes = {n: getattr(torch, d) for st in plan.stages for b in st for n, d in zip(b.names, b.dtypes)}
        self.views: dict[str, torch.Tensor] = {}
        self.spare = None                       # () -> the other bucket buffer, its send done
        self.draining, self.error = False, None

    def dtype(self, name: str, own: torch.dtype) -> torch.dtype:
        return self.dtypes.get(name, own)

    def rows(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        if self.draining:
            return super().rows(name, shape, like)
        v = self.views.get(name)
        if v is None or tuple(v.shape) != tuple(shape):
            raise RuntimeError(f"weight sync: the trainer assembles {name!r} {list(shape)} where the bucket being "
                               f"filled has {sorted(self.views)}; expected the plan's order (sync_layouts)")
        return v

    def scratch(self, nbytes: int, like: torch.Tensor) -> torch.Tensor:
        if self.draining:
            return super().scratch(nbytes, like)
        if self.spare is None:
            raise RuntimeError("weight sync: a column block to receive outside a bucket's fill (fill_stage)")
        try:
            buf = self.spare()
        except CollectiveTimeout as e:          # raised inside the stream it would end it, and its
            self.error, self.draining = e, True     # TP collectives with it: fill_stage raises it
            return super().scratch(nbytes, like)
        if buf.numel() < nbytes:
            raise RuntimeError(f"weight sync: a column block of {nbytes} B exceeds the other bucket buffer "
                               f"({buf.numel()} B)")
        return buf[:nbytes]


def fill_stage(buckets: Sequence[Bucket], it: Iterator[tuple[str, torch.Tensor]], dest: Destination,
               buffer: Callable[[int], torch.Tensor], send: Callable[[int, torch.Tensor], None],
               wait: Callable[[int], None]) -> None:
    """A stage sender's loop over its buckets, two buffers in turn (`buffer(slot)`): wait for
    the slot's last send, fill it from the stream, send it, so one fills while the other is in
    flight. A column block borrows the other buffer (`Destination.scratch`) once its send is
    out. The production sender's (_send_stage) and the memory check's on fake tensors
    (sim/memory._send: `send`, `wait` do nothing there)."""
    held = None
    for i, bucket in enumerate(buckets):
        slot = i % 2
        wait(slot)                                            # its last bucket is out: reuse it
        flat = buffer(slot)[:bucket.total]
        dest.spare = partial(_spare, buffer, wait, 1 - slot)
        held = fill_bucket(bucket, flat, it, held, dest)
        if dest.error is not None:                            # the other buffer's send timed out
            raise dest.error
        send(slot, flat)
    dest.spare = None
    for slot in (0, 1):
        wait(slot)


def _spare(buffer: Callable[[int], torch.Tensor], wait: Callable[[int], None], slot: int) -> torch.Tensor:
    wait(slot)
    return buffer(slot)


def row_pieces(plan: SyncPlan) -> dict[str, list[tuple[int, int]]]:
    """{HF name: its row ranges [first, stop), in order} of the tensors `plan` sends in pieces:
    what a sharded trainer's `sync_stream` gathers at a time (the rest it yields whole)."""
    out: dict[str, list[tuple[int, int]]] = {}
    for stage in plan.stages:
        for b in stage:
            if b.piece is not None:
                out.setdefault(b.names[0], []).append((b.piece.first, b.piece.stop))
    return out


def wire_dtype(rollout_dtype: str, rollout_backend: str, sync_backend: str) -> torch.dtype | None:
    """The dtype floating weights travel in: the engines' (`rollout.dtype`; auto is bf16 for
    vLLM engines fed over NCCL, as they run bf16 on GPUs), None for as-trained (fp32)."""
    if rollout_dtype == "auto":
        use_bf16 = rollout_backend == "vllm" and resolve_backend(sync_backend) == "nccl"
        return torch.bfloat16 if use_bf16 else None
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[rollout_dtype]


@dataclass(frozen=True)
class RemoteBucket:
    """A bucket an engine's workers receive themselves (`prefix`: their group): only this
    header crosses to them, never the bytes. `left_s`: seconds left of the receiver's sync
    deadline when it was handed over (None: none); the worker waits its transfers by then.
    `chain`: the group ranks the bucket travels along (weight_sync.chain): a worker receives
    from the rank before its own and forwards to the one after."""
    prefix: str
    bucket: Bucket
    left_s: float | None = None
    chain: tuple[int, ...] = ()


# ---------------------------------------------------------------------------------------
# transfers inside a pair: point to point, by the sync's deadline
# ---------------------------------------------------------------------------------------
def _isend(channels: SyncChannels, pair: Pair, flat: torch.Tensor, dst: int) -> list:
    if channels.backend == "mpi":
        arr = flat.numpy()
        return [pair.comm.Issend(arr[i:i + MPI_CHUNK], dest=dst, tag=TAG_DATA)     # MPI counts are ints
                for i in range(0, arr.size, MPI_CHUNK)]
    return [pair.pg.send([flat], dst, 0)]


def _irecv(channels: SyncChannels, pair: Pair, flat: torch.Tensor, src: int) -> list:
    if channels.backend == "mpi":
        arr = flat.numpy()
        return [pair.comm.Irecv(arr[i:i + MPI_CHUNK], source=src, tag=TAG_DATA)
                for i in range(0, arr.size, MPI_CHUNK)]
    return [pair.pg.recv([flat], src, 0)]


def _wait(channels: SyncChannels, handles: list, dl: Deadline, phase: str = "a bucket") -> None:
    if not handles:
        return
    if channels.backend == "mpi":           # left pending at the deadline: the pair is abandoned
        deadline.wait_requests(handles, dl, phase)
    else:
        deadline.wait_p2p(handles, channels.backend, dl, phase)


def chain(channels: SyncChannels, pair: Pair, sender: int, targets: Iterable[int]) -> tuple[int, ...]:
    """The ranks a bucket travels along in `pair` (its MPI communicator's ranks, or its torch
    group's: a vLLM replica's TP workers are consecutive links): the stage sender, then each
    target in order. Every member computes the same chain from the plan's targets."""
    if channels.backend == "mpi":
        return (pair.rank(sender),) + tuple(pair.rank(t) for t in targets)
    return (pair.first[sender],) + tuple(r for t in targets for r in pair.ranks(t))


def _pairs(channels: SyncChannels, leader: int, targets: tuple[int, ...]) -> list[tuple[Pair, tuple[int, ...]]]:
    """The sync groups the targets fall in (one per pool they belong to), with their targets."""
    out: dict[tuple[int, int], tuple[Pair, list[int]]] = {}
    for t in targets:
        p = channels.pair(leader, t)
        out.setdefault(p.key, (p, []))[1].append(t)
    return [(p, tuple(ts)) for p, ts in out.values()]


def receiver_grace(timeout_s: float) -> float:
    """Receivers wait this much longer than the senders, so that where a sender is alive it
    gives up first: its report frees its trainer group for the checkpoint that follows."""
    return min(0.25 * timeout_s, 30.0) if timeout_s > 0 else 0.0


def sync_deadline(channels: SyncChannels, members: tuple[int, ...], sender: bool) -> Deadline:
    """The one deadline of every wait of a sync on this rank (0: none)."""
    grace = 0.0 if sender else receiver_grace(channels.timeout_s)
    return Deadline(channels.timeout_s + grace if channels.timeout_s > 0 else 0,
                    f"weight sync over ranks {list(members)}")


def send_weights(channels: SyncChannels, targets: tuple[int, ...], plan: SyncPlan, version: int,
                 stage: int | None, stream: Iterable[tuple[str, torch.Tensor]], leader: bool,
                 on_rendezvous=lambda: None, dest: Destination | None = None) -> None:
    """A trainer rank's part of a sync to the replicas `targets` (world ranks). The group
    leader (plan.senders[0]) sends the plan (the rendezvous); the sender of `stage` streams
    its tensors into buckets, two buffers in turn (one in flight while the next fills), down
    each pair's chain; every other rank runs `stream` for its collectives (megatron's TP
    gathers) and sends nothing. CollectiveTimeout at the deadline (weight_sync.timeout_s):
    the pairs used are abandoned and the rest of `stream` still runs (its TP gathers are the
    trainer group's collectives). `dest`: the Destination `stream` assembles its ranges in
    (the trainer's sync_stream(pieces, dest)); None: a stream of ready tensors, copied."""
    me = channels.world.Get_rank()
    dl = sync_deadline(channels, (me,) + targets, sender=True)
    it, dest = iter(stream), dest or Destination(plan)
    used: list[Pair] = []
    try:
        if leader or stage is not None:
            pairs = _pairs(channels, plan.senders[0], targets)
            used = [p for p, _ in pairs]
        if leader:
            _announce(pairs, plan, version, dl)
            on_rendezvous()
        if stage is not None:
            _send_stage(channels, pairs, plan, stage, it, dl, dest)
    except CollectiveTimeout as e:
        channels.abandon(used, str(e))
        dest.draining = True                    # the rest of the stream into throwaway tensors
        for _ in it:
            pass
        raise
    for got, _ in it:
        raise RuntimeError(f"weight sync: the trainer streamed {got!r} past the plan")


def _send_stage(channels: SyncChannels, pairs: list[tuple[Pair, tuple[int, ...]]], plan: SyncPlan, stage: int,
                it: Iterator[tuple[str, torch.Tensor]], dl: Deadline, dest: Destination) -> None:
    sender = plan.senders[stage]
    for p, _ in pairs:
        if sender not in p.senders:
            raise RuntimeError(f"weight sync: stage {stage}'s sender (rank {sender}) is not a sender of the sync "
                               f"group of trainer group {p.key[0]} and pool {p.key[1]} {list(p.senders)} "
                               f"(config/sync_groups.stage_senders)")
    heads = [(p, chain(channels, p, sender, ts)[1]) for p, ts in pairs]
    works: list[list] = [[], []]
    largest = max((b.total for b in plan.stages[stage]), default=0)     # <= a bucket

    def wait(slot: int) -> None:
        _wait(channels, works[slot], dl)
        works[slot] = []

    def send(slot: int, flat: torch.Tensor) -> None:
        works[slot] = [h for p, head in heads for h in _isend(channels, p, flat, head)]
    fill_stage(plan.stages[stage], it, dest, lambda slot: channels.buffer(largest, slot), send, wait)


def receive_weights(channels: SyncChannels, members: tuple[int, ...], remote=None
                    ) -> tuple[int, SyncPlan, Iterator[dict[str, torch.Tensor] | RemoteBucket]]:
    """A replica's part of the sync over `members` (the trainer leader, then the targets):
    (version, plan, the buckets as dicts of views into this rank's one bucket buffer, each
    valid until the next is received: load it before asking for the next). The iterator
    must be run to its end (this replica forwards every bucket down the chain). With
    `remote` (the pair's engine whose workers receive, SyncChannels.open) the buckets come
    as RemoteBucket headers for the engine to pass on. CollectiveTimeout (from this call or
    the iterator) `receiver_grace` after the senders' deadline; the pair is abandoned."""
    me = channels.world.Get_rank()
    leader, targets = members[0], tuple(members[1:])
    dl = sync_deadline(channels, members, sender=False)
    pair = channels.pair(leader, me)
    mine = tuple(t for t in targets if t in pair.replicas)
    try:
        plan, version = _listen(pair, leader, dl)
    except CollectiveTimeout as e:
        channels.abandon([pair], str(e))
        raise

    def buckets() -> Iterator[dict[str, torch.Tensor] | RemoteBucket]:
        try:
            for s in range(len(plan.stages)):
                links = chain(channels, pair, plan.senders[s], mine)
                if isinstance(pair.pg, RemoteGroup):
                    yield from (RemoteBucket(pair.pg.prefix, b, dl.left(), links) for b in plan.stages[s])
                    continue
                at = links.index(pair.rank(me) if channels.backend == "mpi" else pair.first[me])
                yield from _receive_stage(channels, pair, links, at, plan, s, dl)
        except CollectiveTimeout as e:
            channels.abandon([pair], str(e))
            raise
    return version, plan, buckets()


def _receive_stage(channels: SyncChannels, pair: Pair, links: tuple[int, ...], at: int, plan: SyncPlan, s: int,
                   dl: Deadline) -> Iterator[dict[str, torch.Tensor]]:
    """Stage `s`'s buckets from the link before this one, each forwarded to the link after
    (if any) as soon as it has landed, while the engine loads it. A relay (not the chain's
    last link) lands whole buckets in two buffers in turn, so it receives the next while the
    last is still being forwarded (the chain then runs at the link rate, not half of it):
    at most a bucket more than the last link's one buffer."""
    prev, nxt = links[at - 1], (links[at + 1] if at + 1 < len(links) else None)
    pending: list[tuple[int, int, int, list]] = []            # (slot, first byte, end, forward)
    turn = 0
    for bucket in plan.stages[s]:
        slot = 0
        if nxt is not None and bucket.piece is None:          # pieces land at their own offsets
            slot, turn = turn, turn ^ 1
        buf = channels.buffer(plan.span if slot == 0 else plan.largest, slot)
        lo, hi = bucket.at, bucket.at + bucket.total
        for item in [p for p in pending if p[0] == slot and p[1] < hi and lo < p[2]]:
            _wait(channels, item[3], dl)                      # forwarded: those bytes may be reused
            pending.remove(item)
        region = landing(bucket, buf)
        _wait(channels, _irecv(channels, pair, region, prev), dl)
        if nxt is not None:
            pending.append((slot, lo, hi, _isend(channels, pair, region, nxt)))
        if bucket.complete:                                   # a split tensor: after its last piece
            yield received(bucket, buf)
    for item in pending:
        _wait(channels, item[3], dl)


def _announce(pairs: list[tuple[Pair, tuple[int, ...]]], plan: SyncPlan, version: int, dl: Deadline) -> None:
    """The leader's side of the rendezvous: once every target has announced itself (so that
    it completes on no member before all have joined), each gets (version, a changed flag,
    the pickled plan's length) and, where it has not got this plan from this leader yet,
    the plan."""
    token = np.zeros(sum(len(ts) for _, ts in pairs), dtype=np.int8)
    reqs = [p.comm.Irecv(token[i:i + 1], source=p.rank(t), tag=TAG_PLAN)
            for i, (p, t) in enumerate((p, t) for p, ts in pairs for t in ts)]
    deadline.receive_by(reqs, dl, "the rendezvous (every member joining)")
    payload = np.frombuffer(pickle.dumps(plan), dtype=np.uint8)
    sends, metas = [], []
    for p, ts in pairs:
        for t in ts:
            changed = p.sent.get(t) != plan
            metas.append(np.array([version, changed, payload.size if changed else 0], dtype=np.int64))
            sends.append(p.comm.Isend(metas[-1], dest=p.rank(t), tag=TAG_PLAN))
            if changed:
                sends.append(p.comm.Isend(payload, dest=p.rank(t), tag=TAG_PLAN))
            p.sent[t] = plan
    deadline.wait_requests(sends, dl, "the plan")


def _listen(pair: Pair, leader: int, dl: Deadline) -> tuple[SyncPlan, int]:
    """A target's side of the rendezvous: announce itself, then the version and, where it
    changed, the plan."""
    src = pair.rank(leader)
    meta = np.zeros(3, dtype=np.int64)
    token = np.zeros(1, dtype=np.int8)
    sent = pair.comm.Isend(token, dest=src, tag=TAG_PLAN)              # 1 byte: sent eagerly
    deadline.receive_by([pair.comm.Irecv(meta, source=src, tag=TAG_PLAN)], dl, "the rendezvous (every member joining)")
    deadline.wait_request(sent, dl, "the rendezvous (every member joining)")
    if meta[1]:
        payload = np.empty(int(meta[2]), dtype=np.uint8)
        deadline.receive_by([pair.comm.Irecv(payload, source=src, tag=TAG_PLAN)], dl, "the plan")
        pair.got = pickle.loads(payload.tobytes())
    if pair.got is None:
        raise RuntimeError(f"weight sync: rank {leader} sent no plan to a replica that has none")
    return pair.got, int(meta[0])
