"""One rank's weight-sync channels: a group per (trainer group, pool), made at start.

`SyncChannels.open(groups)` runs on every rank at start, over the groups of
config/sync_groups.py in their fixed order: for each group this rank is in, one MPI
communicator (the plan's rendezvous, and the data path of backend `mpi`) and, for `gloo` /
`nccl`, one torch.distributed group over the same members (each replica brings its ranks:
1, or a vLLM replica's TP workers, which join in their own processes: RemoteGroup). Nothing
is made afterwards, whatever replica subsets the load balancer asks for: a sync to a subset
runs point to point inside its pair's group (weight_sync.py: a chain sender -> target 1 ->
target 2 ..., each bucket forwarded as it lands), so replicas that are not targets take no
part and keep generating. Why a chain and not a broadcast of the whole pool's group, at the
paper's shapes: docs/backends.md#weight-sync.

A torch group needs a store: the pair's leader (stage 0's sender) hosts a `TCPStore` (one per
rank, port chosen by the OS, host from `FLEXMARL_STORE_HOST` or the hostname) and sends its
address over the pair's communicator. Set `GLOO_SOCKET_IFNAME` (and the NCCL variables) to
pick the interface. A pair whose sync passed its deadline is abandoned (its communicator
and group hold a pending transfer): a later sync over it is refused by name; the job is
ending then anyway (SyncTimedOut -> exit 75).
"""
from __future__ import annotations

import atexit
import datetime
import os
import pickle
import socket
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np
import torch

from flexmarl_hpc.runtime import deadline, memtrack
from flexmarl_hpc.runtime.deadline import Deadline

if TYPE_CHECKING:              # no mpi4py at run time: vLLM's TP workers import this module
    from mpi4py import MPI    # (flexmarl_join), and MPI aborts them (docs/backends.md#vllm-engines)

GROUP_TIMEOUT = datetime.timedelta(minutes=30)
CPU_DEFAULT = "mpi"          # weight_sync.backend=auto without CUDA (see resolve_backend)


def resolve_backend(name: str) -> str:
    """`weight_sync.backend` as run: auto is nccl where CUDA is available, else CPU_DEFAULT."""
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else CPU_DEFAULT
    if name == "nccl" and not torch.cuda.is_available():
        raise ValueError("weight_sync.backend: nccl needs CUDA on every sync rank; use gloo or mpi on CPU")
    return name


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


@dataclass
class Pair:
    """This rank's view of one (trainer group, pool) sync group."""
    key: tuple[int, int]                     # (trainer group, pool)
    senders: tuple[int, ...]
    replicas: tuple[int, ...]
    comm: MPI.Comm
    pg: object = None                        # torch group, RemoteGroup, or None (backend mpi)
    first: dict[int, int] = field(default_factory=dict)    # member -> its first rank in pg
    count: dict[int, int] = field(default_factory=dict)    # member -> its ranks in pg
    sent: dict[int, object] = field(default_factory=dict)  # leader: the plan each target last got
    got: object = None                       # replica: the plan it last got
    dead: str = ""                           # why it was abandoned

    @property
    def members(self) -> tuple[int, ...]:
        return self.senders + self.replicas

    def rank(self, member: int) -> int:
        """`member`'s rank in the MPI communicator."""
        return self.members.index(member)

    def ranks(self, member: int) -> range:
        """`member`'s ranks in the torch group (a vLLM replica: one per TP worker)."""
        return range(self.first[member], self.first[member] + self.count[member])

    def check(self) -> "Pair":
        if self.dead:
            raise RuntimeError(f"weight sync group of trainer group {self.key[0]} and pool {self.key[1]} "
                               f"(ranks {list(self.members)}) was abandoned: {self.dead}")
        return self


class SyncChannels:
    """One rank's side of the weight stream: its pairs (made by `open`), the store it hosts,
    and its bucket buffers (two on a sender, one on a receiver)."""

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
        self.pairs: dict[tuple[int, int], Pair] = {}
        self.stores: dict[tuple[str, int], object] = {}      # (host, port) -> TCPStore
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._master: tuple[str, int] | None = None           # address of the store this rank hosts
        self.buffer_allocations = 0                           # tests check it stays small
        self.comms_built = 0                                  # tests check: one per pair, at open
        self.groups_built = 0
        _open.add(self)

    # -- the pairs ------------------------------------------------------------------------
    def open(self, groups: Sequence, remote_of: Callable | None = None, setup: Deadline | None = None) -> None:
        """Make this rank's pairs among `groups` (config/sync_groups.SyncGroup: every rank
        passes the same list, in the same order; each member makes its pairs in that order,
        so the blocking creations cannot wait on each other in a cycle). `remote_of(group)`:
        the engine whose own workers join that group instead of this process (vLLM's TP
        workers on GPUs), or None. `setup`: one deadline for all the groups (start-up's
        run.comm_setup_timeout_s), instead of weight_sync.timeout_s for each: a group's
        members wait for every earlier group's set-up, which a per-group deadline counted."""
        me = self.world.Get_rank()
        for g in groups:
            if me not in g.members:
                continue
            key = (g.group, g.pool)
            if key in self.pairs:
                raise ValueError(f"weight sync: two groups of trainer group {g.group} and pool {g.pool}")
            dl = setup or Deadline(self.timeout_s, f"weight sync group of trainer group {g.group} and pool {g.pool}")
            deadline.join(self.world, g.members, dl, "joining (every member arriving)")
            mpi_group = self.world.Get_group().Incl(list(g.members))
            comm = self.world.Create_group(mpi_group, _tag(g.members))
            mpi_group.Free()
            self.comms_built += 1
            pair = Pair(key, tuple(g.senders), tuple(g.replicas), comm)
            if self.backend != "mpi":
                self._torch_group(pair, None if remote_of is None or me in g.senders else remote_of(g), dl)
            self.pairs[key] = pair

    def _torch_group(self, pair: Pair, remote, dl: Deadline) -> None:
        comm = pair.comm
        counts = np.zeros(comm.Get_size(), dtype=np.int64)
        mine = np.array([1 if remote is None else remote.ranks], dtype=np.int64)
        deadline.wait_request(comm.Iallgather(mine, counts), dl, "the data group's set-up")
        firsts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        pair.first = {m: int(f) for m, f in zip(pair.members, firsts)}
        pair.count = {m: int(c) for m, c in zip(pair.members, counts)}
        addr = _bcast_addr(comm, self._serve() if comm.Get_rank() == 0 else None, dl)
        prefix = f"wsync_{pair.key[0]}_{pair.key[1]}/"
        me, size = self.world.Get_rank(), int(counts.sum())
        if remote is not None:
            remote.join(addr, prefix, pair.first[me], size, self.backend, self.group_timeout)
            pair.pg = RemoteGroup(prefix, remote)
        else:
            store = self.stores.get(addr) or self._connect(addr)
            pair.pg = new_group(self.backend, torch.distributed.PrefixStore(prefix, store), pair.first[me],
                                size, self.group_timeout, self.device)
        self.groups_built += 1

    def pair(self, leader: int, replica: int) -> Pair:
        """The pair of the trainer group led by `leader` and the pool of `replica`."""
        for p in self.pairs.values():
            if p.senders[0] == leader and replica in p.replicas:
                return p.check()
        raise RuntimeError(f"weight sync: rank {self.world.Get_rank()} has no sync group of trainer leader "
                           f"{leader} and replica {replica}; groups are made at start, one per (trainer "
                           f"group, pool) (SyncChannels.open, config/sync_groups.py)")

    def abandon(self, pairs: Iterable[Pair], why: str) -> None:
        """Pairs whose transfer was given up at its deadline (still pending there): never used
        again. A torch group is aborted, which releases a transfer stuck in it (RemoteGroup:
        its workers leave it); the MPI communicator is left unfreed (freeing one with a
        pending request is erroneous)."""
        for p in pairs:
            if p.dead:
                continue
            p.dead = why
            if hasattr(p.pg, "abort"):
                p.pg.abort()
            elif p.pg is not None:
                _shutdown(p.pg)

    def buffer(self, nbytes: int, slot: int = 0) -> torch.Tensor:
        """Bucket buffer `slot` (0, 1), grown (never duplicated) to the largest bucket."""
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            self._buffers[slot] = None                        # free the old one first
            self._buffers[slot] = host_bytes(nbytes) if self.device.type == "cpu" else \
                torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.buffer_allocations += 1
        return self._buffers[slot][:nbytes]

    def _serve(self) -> tuple[str, int]:
        """The store this rank hosts for the pairs it leads (created once)."""
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
        for p in self.pairs.values():
            if p.pg is not None and not p.dead:
                _shutdown(p.pg)
            p.pg = None
        self.pairs.clear()
        self.stores.clear()
        self._master = None
        _open.discard(self)


def _tag(members: tuple[int, ...]) -> int:
    """MPI_Comm_create_group's tag: a stable function of the member set."""
    return hash(members) & 0x7FFF


def new_group(backend: str, store, rank: int, size: int, timeout: datetime.timedelta = GROUP_TIMEOUT,
              device: torch.device | None = None):
    """A torch.distributed group over `store` (gloo on CPU, NCCL on GPUs); `timeout`: its
    transfers' own (weight_sync.timeout_s, SyncChannels.group_timeout). NCCL with `device`:
    the communicator is made now, bound to it (every member is in `open` together), so the
    chain's send/recv run on it instead of torch making a 2-rank communicator per peer
    (pytorch#129147; see docs/backends.md#weight-sync for the torch versions that still do)."""
    if backend == "gloo":
        return torch.distributed.ProcessGroupGloo(store, rank, size, timeout)
    opts = torch.distributed.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    pg = torch.distributed.ProcessGroupNCCL(store, rank, size, opts)
    if device is not None and device.type == "cuda" and hasattr(pg, "eager_connect_single_device"):
        pg.eager_connect_single_device(device)
    return pg


@dataclass(frozen=True)
class RemoteGroup:
    """A data group this process does not sit in: its engine's workers do (`remote.join`)."""
    prefix: str
    remote: object

    def shutdown(self) -> None:
        self.remote.leave(self.prefix)


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
