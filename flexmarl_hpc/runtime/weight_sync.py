"""Weight streaming from a trainer group's pipeline stages to the replicas serving an agent.

Weights leave a trainer only when the orchestrator asks for a sync. The trainer streams its
HF-named tensors one at a time (megatron: each tensor, or each piece's rows of one larger
than a bucket, assembled in HF layout on the device from the TP shards holding those rows,
trainer/megatron/trainer.py `sync_stream`), each PP stage
from its own sender (its TP rank 0 of data-parallel replica 0), and the sender packs them
into fixed-size buckets (`weight_sync.bucket_mb`) broadcast to the target replicas. A tensor
larger than a bucket (a 152k-row embedding or LM head) goes as pieces of whole rows, a
bucket each (`Piece`), so the sender's two bucket buffers (one in flight while the next
fills) never exceed two buckets, whatever the model, and a sharded trainer gathers one
piece's rows at a time (`row_pieces`), never the whole tensor. A receiver has one buffer, of a bucket
or of the largest split tensor: each piece lands in place at its offset in that tensor
(`landing`), which goes to the engine whole after its last piece (`received`; engines load
whole tensors: vLLM's weight loaders shard a full tensor per TP rank). Receivers hand each
bucket to the engine before the next arrives (`RolloutEngine.load_weights` takes the
buckets as an iterable), and mark the new version only after the last, so nothing samples
with half-updated weights.

The layout (`Plan`: per stage, its sender and buckets of names, dtypes, shapes, offsets) is
a pure function of the model, TP/PP and the bucket size; the group leader sends it over an
MPI communicator of {leader} + {targets}: the rendezvous (members arrive at different times,
and it is waited for without spinning, comm.py), and a member set that already carried the
layout gets 24 bytes instead. The buckets then go over a data group per (stage sender +
targets) (`weight_sync.backend`, see bench/bench_weight_sync.py):

- `mpi`: an MPI communicator of those members, one `Ibcast` per bucket waited for with
  `Test` and back-off sleeps under the sync's deadline (a blocking `Bcast` could not be given
  up at a deadline; measured no slower, docs/LOG.md 2026-11-25: hung collectives).
- `gloo` / `nccl`: a torch.distributed group (`ProcessGroupGloo` / `ProcessGroupNCCL`) over
  the same members. On GPUs this is the production path: buckets live on the device and NCCL
  moves them GPU to GPU. On CPU the same code runs over gloo.

Every wait of a sync has one deadline, `weight_sync.timeout_s` from its start on that rank
(runtime/deadline.py; receivers `receiver_grace` longer, so a live sender gives up first):
the communicators' set-up (every member joins first), the plan's rendezvous (an allreduce,
complete on no member before every member has joined), each data group's set-up and each
bucket (`Ibcast` + `Test`; torch `Work`s by `deadline.wait_works`). Past it the rank raises
CollectiveTimeout and forgets the communicators and data groups the sync used (`abandon`: an
abandoned collective stays pending in them; torch groups are aborted); its worker reports it
(messages.SyncTimedOut). NCCL and gloo groups get it as their own timeout too, with
TORCH_NCCL_ASYNC_ERROR_HANDLING set, so NCCL's watchdog ends what no wait of ours watches.
A vLLM replica's TP workers (RemoteGroup) receive in their own processes: each bucket's
header carries the seconds left, and the worker waits its broadcast with that deadline.

Groups are built on first use per member set and cached (at most MAX_GROUPS per rank, least
recently used closed first: the orchestrator's member sets are subsets of a pool, so they
repeat). A torch group needs a store: the set's root hosts a `TCPStore` (one per rank, port
chosen by the OS, host from `FLEXMARL_STORE_HOST` or the rank's hostname) and sends its
address over the set's MPI communicator. Set `GLOO_SOCKET_IFNAME` (and the NCCL variables) to
pick the network interface. The orchestrator issues syncs in one global order, so every
member meets the collective calls in the same sequence and concurrent syncs cannot deadlock.
"""
from __future__ import annotations

import atexit
import datetime
import os
import pickle
import socket
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Iterator, Literal

import numpy as np
import torch
from mpi4py import MPI

from flexmarl_hpc.runtime import deadline, memtrack
from flexmarl_hpc.runtime.deadline import CollectiveTimeout, Deadline

Backend = Literal["mpi", "gloo", "nccl"]
GROUP_TIMEOUT = datetime.timedelta(minutes=30)
MAX_GROUPS = 16          # data groups (and their communicators) a rank keeps open


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
class Plan:
    """What one sync carries, per PP stage: its sender (world rank), its buckets, the id of
    its data group with these targets, and the ids of that sender's groups still open (a
    receiver closes the others: see GroupIds)."""
    senders: tuple[int, ...]
    stages: tuple[tuple[Bucket, ...], ...]
    gids: tuple[int, ...] = ()
    live: tuple[tuple[int, ...], ...] = ()

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
                held: tuple[str, torch.Tensor] | None = None) -> tuple[str, torch.Tensor] | None:
    """Copy the bucket's tensors from the trainer's stream `it` into `flat`, cast to the
    wire dtype. A split tensor comes either as its pieces, one per bucket (a sharded trainer
    gathers only those rows: `row_pieces`), or whole at its first piece and `held` (a
    reference, never a copy) until its last: returns what is held for the next bucket."""
    views = bucket_views(bucket, flat)
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
        views[name].copy_(t)
        del t                           # the stream's next tensor must not meet this one
    return held


def row_pieces(plan: Plan) -> dict[str, list[tuple[int, int]]]:
    """{HF name: its row ranges [first, stop), in order} of the tensors `plan` sends in pieces:
    what a sharded trainer's `sync_stream` gathers at a time (the rest it yields whole)."""
    out: dict[str, list[tuple[int, int]]] = {}
    for stage in plan.stages:
        for b in stage:
            if b.piece is not None:
                out.setdefault(b.names[0], []).append((b.piece.first, b.piece.stop))
    return out


def host_bytes(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A host byte buffer on transparent huge pages: numpy madvises large allocations
    (MADV_HUGEPAGE), torch's allocator does not. Measured here, an MPI Bcast between
    torch-allocated buffers takes 1.25-1.9x as long as between numpy-allocated ones (TLB
    misses on 4 KiB pages across a model-sized copy): that, not the protocol, was most of the
    gap between our sync and a raw Bcast of numpy buffers. `pin`: page-locked instead (CUDA's
    host allocator), so copies to and from a GPU run asynchronously (state swap)."""
    if pin:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return memtrack.external(torch.from_numpy(np.empty(nbytes, dtype=np.uint8)))


CPU_DEFAULT: Backend = "mpi"          # weight_sync.backend=auto without CUDA (see resolve_backend)


def resolve_backend(name: str) -> Backend:
    """`weight_sync.backend` as run: auto is nccl where CUDA is available, else CPU_DEFAULT."""
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else CPU_DEFAULT
    if name == "nccl" and not torch.cuda.is_available():
        raise ValueError("weight_sync.backend: nccl needs CUDA on every sync rank; use gloo or mpi on CPU")
    return name  # type: ignore[return-value]


def wire_dtype(rollout_dtype: str, rollout_backend: str, sync_backend: str) -> torch.dtype | None:
    """The dtype floating weights travel in: the engines' (`rollout.dtype`; auto is bf16 for
    vLLM engines fed over NCCL, as they run bf16 on GPUs), None for as-trained (fp32)."""
    if rollout_dtype == "auto":
        use_bf16 = rollout_backend == "vllm" and resolve_backend(sync_backend) == "nccl"
        return torch.bfloat16 if use_bf16 else None
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[rollout_dtype]


class GroupIds:
    """The data groups of one trainer group, identical on each of its ranks (all of them see
    every Sync): an id per (stage, targets, agent), at most `cap` open, least recently used
    closed first. Per agent, because a replica's workers of that agent's engine are the ones
    that join (vLLM). The plan carries the ids, so receivers close what the senders closed and
    a set seen again after its group was closed gets a new group (a new store prefix)."""

    def __init__(self, cap: int = MAX_GROUPS):
        self.cap, self.ids, self.next = cap, OrderedDict(), 0

    def use(self, stage: int, targets: tuple[int, ...], agent: str = "") -> int:
        key = (stage, targets, agent)
        if key in self.ids:
            self.ids.move_to_end(key)
        else:
            self.next += 1
            self.ids[key] = self.next
            while len(self.ids) > self.cap:
                self.ids.popitem(last=False)
        return self.ids[key]

    def live(self, stage: int) -> tuple[int, ...]:
        return tuple(sorted(g for (s, *_), g in self.ids.items() if s == stage))

    def drop(self, targets: tuple[int, ...], agent: str = "") -> None:
        """Forget the ids of a sync given up at its deadline: a set seen again gets new
        groups (a new store prefix; the abandoned ones' keys stay in the store)."""
        for key in [k for k in self.ids if k[1:] == (targets, agent)]:
            del self.ids[key]


class SyncChannels:
    """One rank's side of the weight broadcast: cached MPI communicators per member set
    (world ranks, root first), torch data groups per (member set, id), the rank's store, and
    its bucket buffers (two on a sender, one on a receiver)."""

    def __init__(self, world: MPI.Comm, backend: str = "auto", device: str | torch.device | None = None,
                 timeout_s: float = 0.0):
        backend = resolve_backend(backend)
        if backend not in ("mpi", "gloo", "nccl"):
            raise ValueError(f"weight_sync.backend: {backend!r}, expected auto, mpi, gloo or nccl")
        if device is None:        # NCCL moves device memory: buckets on this rank's current GPU
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        self.world, self.backend, self.device = world, backend, torch.device(device)
        self.timeout_s = timeout_s                            # weight_sync.timeout_s; 0: none
        self.group_timeout = datetime.timedelta(seconds=timeout_s) if timeout_s > 0 else GROUP_TIMEOUT
        if backend == "nccl":       # NCCL's watchdog tears a rank down after a timed-out collective
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        self.cache: dict[tuple[int, ...], MPI.Comm] = {}
        self.groups: OrderedDict[tuple[tuple[int, ...], int], object] = OrderedDict()
        self.stores: dict[tuple[str, int], object] = {}      # (host, port) -> TCPStore
        self.layouts: dict[tuple[int, ...], Plan] = {}         # last plan each member set carried
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._master: tuple[str, int] | None = None           # address of the store this rank hosts
        self.buffer_allocations = 0                           # tests check it stays small
        self.groups_built = 0
        _open.add(self)

    # -- MPI communicator: the plan rendezvous, and the data path of backend "mpi" -------
    def get(self, members: tuple[int, ...], dl: Deadline | None = None) -> MPI.Comm:
        """The member set's communicator, made on its first use (after every member has
        joined by `dl`: MPI_Comm_create_group blocks until they all have)."""
        comm = self.cache.get(members)
        if comm is None:
            if dl is not None:
                deadline.join(self.world, members, dl, "joining (every member arriving)")
            group = self.world.Get_group().Incl(list(members))
            # tag: a stable function of the member set so concurrent creations don't mix
            comm = self.world.Create_group(group, hash(members) & 0x7FFF)
            group.Free()
            self.cache[members] = comm
        return comm

    def buffer(self, nbytes: int, slot: int = 0) -> torch.Tensor:
        """Bucket buffer `slot` (0, 1), grown (never duplicated) to the largest bucket."""
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            self._buffers[slot] = None                        # free the old one first
            self._buffers[slot] = host_bytes(nbytes) if self.device.type == "cpu" else \
                torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.buffer_allocations += 1
        return self._buffers[slot][:nbytes]

    # -- torch.distributed data group of a member set (backends gloo / nccl) -------------
    def group(self, members: tuple[int, ...], gid: int = 0, remote=None, dl: Deadline | None = None):
        """The data group of `members` (root first) with id `gid`. Each member brings its
        ranks: 1, or with `remote` (an engine whose own workers receive, e.g. vLLM's TP
        workers) `remote.ranks`, which join through `remote.join` instead of this process.
        Its set-up waits by `dl`; the group's own timeout is weight_sync.timeout_s."""
        key = (members, gid)
        pg = self.groups.get(key)
        if pg is None:
            dl = dl or Deadline(0)
            comm = self.get(members, dl)
            counts = np.zeros(comm.Get_size(), dtype=np.int64)
            deadline.wait_request(comm.Iallgather(np.array([1 if remote is None else remote.ranks],
                                                           dtype=np.int64), counts), dl, "the data group's set-up")
            addr = _bcast_addr(comm, self._serve() if comm.Get_rank() == 0 else None, dl)
            prefix = f"wsync_{gid}_" + "_".join(map(str, members)) + "/"
            first, size = int(counts[:comm.Get_rank()].sum()), int(counts.sum())
            if remote is not None:
                remote.join(addr, prefix, first, size, self.backend, self.group_timeout)
                pg = RemoteGroup(prefix, remote)
            else:
                store = self.stores.get(addr) or self._connect(addr)
                pg = new_group(self.backend, torch.distributed.PrefixStore(prefix, store), first, size,
                               self.group_timeout)
            self.groups[key] = pg
            self.groups_built += 1
        self.groups.move_to_end(key)
        return pg

    def forget(self, root: int, live: Iterable[int]) -> None:
        """Close the data groups rooted at `root` whose ids it no longer keeps."""
        live = set(live)
        for key in [k for k in self.groups if k[0][0] == root and k[1] not in live]:
            _shutdown(self.groups.pop(key))

    def abandon(self, sets: Iterable[tuple[int, ...]]) -> None:
        """Drop the communicators, plans and data groups of member sets whose collective was
        given up at its deadline (still pending there: they must not carry another sync). A
        torch group is aborted, which releases a transfer stuck in it (RemoteGroup: its
        workers leave it); an MPI communicator is left unfreed (freeing one with a pending
        request is erroneous)."""
        sets = set(sets)
        for members in sets:
            self.cache.pop(members, None)
            self.layouts.pop(members, None)
        for key in [k for k in self.groups if k[0] in sets]:
            pg = self.groups.pop(key)
            if hasattr(pg, "abort"):
                pg.abort()
            else:
                _shutdown(pg)

    def _serve(self) -> tuple[str, int]:
        """The store this rank hosts for the member sets it is the root of (created once)."""
        if self._master is not None:
            return self._master
        host = os.environ.get("FLEXMARL_STORE_HOST") or socket.gethostname()
        store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                           timeout=GROUP_TIMEOUT)
        self._master = (host, store.port)
        self.stores[self._master] = store
        return self._master

    def _connect(self, addr: tuple[str, int]):
        store = self.stores[addr] = torch.distributed.TCPStore(addr[0], addr[1], is_master=False,
                                                               timeout=GROUP_TIMEOUT)
        return store

    def close(self) -> None:
        """Tear the torch groups down before the stores (a group alive at interpreter exit
        aborts the process)."""
        while self.groups:
            _shutdown(self.groups.popitem()[1])
        self.stores.clear()
        self._master = None
        _open.discard(self)


def new_group(backend: str, store, rank: int, size: int, timeout: datetime.timedelta = GROUP_TIMEOUT):
    """A torch.distributed group over `store` (gloo on CPU, NCCL on GPUs); `timeout`: its
    collectives' own (weight_sync.timeout_s, SyncChannels.group_timeout)."""
    if backend == "gloo":
        return torch.distributed.ProcessGroupGloo(store, rank, size, timeout)
    opts = torch.distributed.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return torch.distributed.ProcessGroupNCCL(store, rank, size, opts)


@dataclass(frozen=True)
class RemoteGroup:
    """A data group this process does not sit in: its engine's workers do (`remote.join`)."""
    prefix: str
    remote: object

    def shutdown(self) -> None:
        self.remote.leave(self.prefix)


@dataclass(frozen=True)
class RemoteBucket:
    """A bucket an engine's workers receive themselves (`prefix`: their group): only this
    header crosses to them, never the bytes. `left_s`: seconds left of the receiver's sync
    deadline when it was handed over (None: none); the worker waits its broadcast by then."""
    prefix: str
    bucket: Bucket
    left_s: float | None = None


def _shutdown(pg) -> None:
    """Free a group's communicator now (NCCL holds device memory), not at garbage collection."""
    if hasattr(pg, "shutdown"):
        try:
            pg.shutdown()
        except RuntimeError:
            pass


_open: weakref.WeakSet[SyncChannels] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for ch in list(_open):
        ch.close()


MPI_CHUNK = 1 << 30


def receiver_grace(timeout_s: float) -> float:
    """Receivers wait this much longer than the senders, so that where a sender is alive it
    gives up first: its report frees its trainer group for the checkpoint that follows."""
    return min(0.25 * timeout_s, 30.0) if timeout_s > 0 else 0.0


def sync_deadline(channels: SyncChannels, members: tuple[int, ...], sender: bool) -> Deadline:
    """The one deadline of every wait of a sync on this rank (0: none)."""
    grace = 0.0 if sender else receiver_grace(channels.timeout_s)
    return Deadline(channels.timeout_s + grace if channels.timeout_s > 0 else 0,
                    f"weight sync over ranks {list(members)}")


def _bcast_addr(comm: MPI.Comm, addr, dl: Deadline):
    """The root's store address to every member, by the deadline."""
    n = np.zeros(1, dtype=np.int64)
    data = np.frombuffer(pickle.dumps(addr), dtype=np.uint8) if comm.Get_rank() == 0 else None
    if data is not None:
        n[0] = data.size
    deadline.bcast(comm, n, 0, dl, "the data group's store address")
    if data is None:
        data = np.empty(int(n[0]), dtype=np.uint8)
    deadline.bcast(comm, data, 0, dl, "the data group's store address")
    return pickle.loads(data.tobytes())


def bcast_bucket(channels: SyncChannels, members: tuple[int, ...], gid: int, flat: torch.Tensor,
                 dl: Deadline):
    """Broadcast one bucket from members[0]; returns the torch Work to wait on by `dl`
    (None: done). mpi: an Ibcast waited for here (Test + back-off; MPICH progresses it only
    inside Test), by `dl`."""
    if channels.backend == "mpi":
        arr = flat.numpy()
        comm = channels.get(members, dl)
        for start in range(0, arr.size, MPI_CHUNK):           # MPI counts are ints
            deadline.bcast(comm, arr[start:start + MPI_CHUNK], 0, dl, "a bucket")
        return None
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    return channels.group(members, gid, dl=dl).broadcast([flat], opts)


def _wait(work, dl: Deadline) -> None:
    if work is not None:
        deadline.wait_works([work], dl, "a bucket")


def send_weights(channels: SyncChannels, targets: tuple[int, ...], plan: Plan, version: int,
                 stage: int | None, stream: Iterable[tuple[str, torch.Tensor]], leader: bool,
                 on_rendezvous=lambda: None) -> None:
    """A trainer rank's part of a sync to the replicas `targets` (world ranks). The group
    leader sends the plan (the rendezvous); the sender of `stage` streams its tensors into
    buckets, two buffers in turn (one broadcasts while the next fills); every other rank
    runs `stream` for its collectives (megatron's TP gathers) and sends nothing.
    CollectiveTimeout at the deadline (weight_sync.timeout_s): the sets used are abandoned
    and the rest of `stream` still runs (its TP gathers are the trainer group's collectives)."""
    me = channels.world.Get_rank()
    dl = sync_deadline(channels, (me,) + targets, sender=True)
    used = [(me,) + targets] if leader else []
    it = iter(stream)
    try:
        if leader:
            _rendezvous(channels, (me,) + targets, plan, version, dl)
            on_rendezvous()
        if stage is not None:
            used.append((plan.senders[stage],) + targets)
            _send_stage(channels, used[-1], plan, stage, it, dl)
    except CollectiveTimeout:
        channels.abandon(used)
        for _ in it:
            pass
        raise
    for got, _ in it:
        raise RuntimeError(f"weight sync: the trainer streamed {got!r} past the plan")


def _send_stage(channels: SyncChannels, members: tuple[int, ...], plan: Plan, stage: int,
                it: Iterator[tuple[str, torch.Tensor]], dl: Deadline) -> None:
    channels.forget(plan.senders[stage], plan.live[stage] if plan.live else ())
    works: list = [None, None]
    largest = max((b.total for b in plan.stages[stage]), default=0)     # <= a bucket
    held = None                                               # a split tensor between pieces
    for i, bucket in enumerate(plan.stages[stage]):
        slot = i % 2
        _wait(works[slot], dl)                                # its last bucket is out: reuse it
        flat = channels.buffer(largest, slot)[:bucket.total]     # sized once per plan
        held = fill_bucket(bucket, flat, it, held)
        works[slot] = bcast_bucket(channels, members, plan.gids[stage] if plan.gids else 0, flat, dl)
    for w in works:
        _wait(w, dl)


def receive_weights(channels: SyncChannels, members: tuple[int, ...], remote=None
                    ) -> tuple[int, Plan, Iterator[dict[str, torch.Tensor] | RemoteBucket]]:
    """A replica's part: (version, plan, the buckets as dicts of views into this rank's one
    bucket buffer, each valid until the next is received: load it before asking for the
    next). The iterator must be run to its end (every bucket is a collective). With
    `remote` (see SyncChannels.group) the engine's workers receive: the buckets come as
    RemoteBucket headers for the engine to pass on. CollectiveTimeout (from this call or the
    iterator) `receiver_grace` after the senders' deadline; the sets used are abandoned."""
    dl = sync_deadline(channels, members, sender=False)
    used = [members]
    try:
        plan, version = _rendezvous(channels, members, None, -1, dl)
    except CollectiveTimeout:
        channels.abandon(used)
        raise

    def buckets() -> Iterator[dict[str, torch.Tensor] | RemoteBucket]:
        try:
            for s, stage in enumerate(plan.stages):
                data = (plan.senders[s],) + tuple(members[1:])
                used.append(data)
                yield from _receive_stage(channels, data, plan, s, remote, dl)
        except CollectiveTimeout:
            channels.abandon(used)
            raise
    return version, plan, buckets()


def _receive_stage(channels: SyncChannels, data: tuple[int, ...], plan: Plan, s: int, remote,
                   dl: Deadline) -> Iterator[dict[str, torch.Tensor] | RemoteBucket]:
    channels.forget(plan.senders[s], plan.live[s] if plan.live else ())
    gid = plan.gids[s] if plan.gids else 0
    if remote is not None:
        pg = channels.group(data, gid, remote, dl)
        yield from (RemoteBucket(pg.prefix, b, dl.left()) for b in plan.stages[s])
        return
    for bucket in plan.stages[s]:
        buf = channels.buffer(plan.span, 0)
        _wait(bcast_bucket(channels, data, gid, landing(bucket, buf), dl), dl)
        if bucket.complete:                                   # a split tensor: after its last piece
            yield received(bucket, buf)


def _rendezvous(channels: SyncChannels, members: tuple[int, ...], plan: Plan | None,
                version: int, dl: Deadline) -> tuple[Plan, int]:
    """The plan from the root, waited for without spinning, by `dl`. A member set that
    already carried this plan gets one 24-byte allreduce (version, a changed flag, the
    pickled plan's length: the root's values, zeros from the others), not the plan: one
    round of back-off wake-ups, not two, on every later sync. An allreduce, not a broadcast,
    so that it completes on no member, the root included, before every member has joined."""
    comm = channels.get(members, dl)
    meta = np.zeros(3, dtype=np.int64)
    payload = None
    if plan is not None:
        changed = channels.layouts.get(members) != plan
        payload = np.frombuffer(pickle.dumps(plan), dtype=np.uint8) if changed else None
        meta[:] = (version, changed, 0 if payload is None else payload.size)
    deadline.allreduce_sum(comm, meta, dl, "the rendezvous (every member joining)")
    if meta[1]:
        if payload is None:
            payload = np.empty(int(meta[2]), dtype=np.uint8)
        deadline.bcast(comm, payload, 0, dl, "the plan")
        channels.layouts[members] = plan if plan is not None else pickle.loads(payload.tobytes())
    return channels.layouts[members], int(meta[0])
