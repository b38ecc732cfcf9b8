"""Weight broadcast from a trainer group's leader to the replicas serving an agent.

The leader's HF-named tensors travel as one byte stream laid out by a `Header` (names,
dtypes, shapes, 16-byte aligned offsets), broadcast to {leader} + {target replicas}. The
header goes first over an MPI communicator of the member set: it is the rendezvous (members
arrive at different times, and it is waited for without spinning, comm.py); a layout the
member set already carried is not sent again (24 bytes per sync). The bytes then go over
the member set's data group (`weight_sync.backend`, see bench/bench_weight_sync.py):

- `mpi`: the same MPI communicator, one `Ibcast` waited for with `Test` and back-off sleeps
  under the sync's deadline (runtime/deadline.py). MPICH progresses a non-blocking
  collective only inside Test, yet measured against a blocking `Bcast` of the same bytes it
  was as fast or faster (docs/LOG.md, 2026-11-25: hung collectives), and a blocking call
  could not be given up at a deadline.
- `gloo` / `nccl`: a torch.distributed backend group (`ProcessGroupGloo` / `ProcessGroupNCCL`)
  over the same members, in collectives of at most `bucket_bytes`, all issued at once.
  On GPUs this is the production path: staging lives on the device, NCCL moves it GPU to
  GPU (GPUDirect RDMA where the fabric has it) and the engine loads device tensors. On CPU
  the same code runs over gloo, whose waits block in the kernel instead of spinning.

Every wait of a sync has one deadline, `weight_sync.timeout_s` from the start
(runtime/deadline.py): the header's rendezvous (an allreduce, complete only once every
member has joined), the layout and the bytes. Past it the rank raises CollectiveTimeout,
forgets the member set's communicator and group (an abandoned collective stays pending in
them) and its worker reports the failure; NCCL and gloo groups also get it as their own
timeout, with TORCH_NCCL_ASYNC_ERROR_HANDLING set, so NCCL's watchdog ends what no wait of
ours watches.

Groups are built once per member set and cached. A torch group needs a store: the member
set's root hosts a `TCPStore` (one per rank, port chosen by the OS, host from
`FLEXMARL_STORE_HOST` or the rank's hostname) and sends its address to the members over
the set's MPI communicator, so nothing but the MPI job is needed to find it; each group's
keys live under a prefix named after its members. Set `GLOO_SOCKET_IFNAME` (and the NCCL
variables) to pick the network interface.

Every rank keeps ONE staging buffer (per device), grown to the largest model it receives:
received tensors are views into it, valid until the rank's next sync (engines copy on
load). A sender whose parameters already live in sync layout (`packed`) broadcasts them in
place, with no packing copy. The orchestrator issues syncs in one global order, so every
member meets the collective calls in the same sequence and concurrent syncs cannot
deadlock.
"""
from __future__ import annotations

import atexit
import datetime
import os
import pickle
import socket
import weakref
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch
from mpi4py import MPI

from flexmarl_hpc.runtime import deadline
from flexmarl_hpc.runtime.comm import bcast_obj
from flexmarl_hpc.runtime.deadline import Deadline

Backend = Literal["mpi", "gloo", "nccl"]
GROUP_TIMEOUT = datetime.timedelta(minutes=30)
MPI_CHUNK = 1 << 30


@dataclass(frozen=True)
class Header:
    version: int
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    nbytes: tuple[int, ...]
    offsets: tuple[int, ...]           # 16-byte aligned, so every dtype can be viewed in place
    total: int


def _header(named: dict[str, torch.Tensor], version: int, wire: torch.dtype | None = None) -> Header:
    ts = list(named.values())
    dts = [wire if wire is not None and t.is_floating_point() else t.dtype for t in ts]
    nbytes = tuple(t.numel() * dt.itemsize for t, dt in zip(ts, dts))
    offsets, off = [], 0
    for nb in nbytes:
        offsets.append(off)
        off += -(-nb // 16) * 16
    return Header(version, tuple(named), tuple(str(dt).removeprefix("torch.") for dt in dts),
                  tuple(tuple(t.shape) for t in ts), nbytes, tuple(offsets), off)


def _pack(named: dict[str, torch.Tensor], header: Header, flat: torch.Tensor | np.ndarray) -> None:
    flat = torch.as_tensor(flat)                                # a numpy buffer is shared, not copied
    for t, dt, nb, off in zip(named.values(), header.dtypes, header.nbytes, header.offsets):
        flat[off:off + nb].view(getattr(torch, dt)).copy_(t.detach().reshape(-1))


def _unpack(header: Header, flat: torch.Tensor | np.ndarray) -> dict[str, torch.Tensor]:
    flat = torch.as_tensor(flat)
    # views into the staging buffer: no copy (valid until this rank's next sync)
    return {name: flat[off:off + nb].view(getattr(torch, dt)).reshape(shape)
            for name, dt, shape, nb, off in zip(header.names, header.dtypes, header.shapes,
                                                header.nbytes, header.offsets)}


def host_bytes(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A host byte buffer on transparent huge pages: numpy madvises large allocations
    (MADV_HUGEPAGE), torch's allocator does not. Measured here, an MPI Bcast between
    torch-allocated buffers takes 1.25-1.9x as long as between numpy-allocated ones (TLB
    misses on 4 KiB pages across a model-sized copy): that, not the protocol, was most of the
    gap between our sync and a raw Bcast of numpy buffers. `pin`: page-locked instead (CUDA's
    host allocator), so copies to and from a GPU run asynchronously (state swap)."""
    if pin:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8))


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


class SyncChannels:
    """One rank's side of the weight broadcast: cached MPI communicators and torch groups per
    member set (world ranks, root first), the rank's store, and its one staging buffer."""

    def __init__(self, world: MPI.Comm, backend: str = "auto", device: str | torch.device | None = None,
                 timeout_s: float = 0.0):
        backend = resolve_backend(backend)
        if backend not in ("mpi", "gloo", "nccl"):
            raise ValueError(f"weight_sync.backend: {backend!r}, expected auto, mpi, gloo or nccl")
        if device is None:        # NCCL moves device memory: stage on this rank's current GPU
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        self.world, self.backend, self.device = world, backend, torch.device(device)
        self.timeout_s = timeout_s                            # weight_sync.timeout_s; 0: none
        self.group_timeout = datetime.timedelta(seconds=timeout_s) if timeout_s > 0 else GROUP_TIMEOUT
        if backend == "nccl":       # NCCL's watchdog tears a rank down after a timed-out collective
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        self.cache: dict[tuple[int, ...], MPI.Comm] = {}
        self.groups: dict[tuple[int, ...], object] = {}
        self.stores: dict[tuple[str, int], object] = {}      # (host, port) -> TCPStore
        self.layouts: dict[tuple[int, ...], Header] = {}       # last layout each member set carried
        self._views: tuple[Header, int, dict[str, torch.Tensor]] | None = None
        self._staging: torch.Tensor | None = None
        self._master: tuple[str, int] | None = None           # address of the store this rank hosts
        self.staging_allocations = 0                          # tests check it stays at 1
        _open.add(self)

    # -- MPI communicator: the header rendezvous, and the data path of backend "mpi" -------
    def get(self, members: tuple[int, ...], dl: Deadline | None = None) -> MPI.Comm:
        """The member set's communicator, made on its first sync (after every member has
        joined by `dl`: making it blocks until they all have)."""
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

    def staging(self, nbytes: int) -> torch.Tensor:
        """This rank's byte buffer, grown (never duplicated) to the largest transfer."""
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = None                              # free the old one first
            self._staging = host_bytes(nbytes) if self.device.type == "cpu" else \
                torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.staging_allocations += 1
        return self._staging[:nbytes]

    def views(self, header: Header, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """`_unpack(header, flat)`, reused while the layout and the buffer stay the same."""
        key = (replace(header, version=0), flat.data_ptr())
        if self._views is None or self._views[:2] != key:
            self._views = (*key, _unpack(header, flat))
        return self._views[2]

    # -- torch.distributed group of a member set (backends gloo / nccl) ---------------------
    def group(self, members: tuple[int, ...]):
        pg = self.groups.get(members)
        if pg is None:
            comm = self.get(members)
            addr = self._serve() if comm.Get_rank() == 0 else None
            addr = bcast_obj(comm, addr, 0)
            store = self.stores.get(addr) or self._connect(addr)
            prefixed = torch.distributed.PrefixStore("wsync_" + "_".join(map(str, members)) + "/", store)
            if self.backend == "gloo":
                pg = torch.distributed.ProcessGroupGloo(prefixed, comm.Get_rank(), comm.Get_size(),
                                                        self.group_timeout)
            else:
                opts = torch.distributed.ProcessGroupNCCL.Options()
                opts._timeout = self.group_timeout
                pg = torch.distributed.ProcessGroupNCCL(prefixed, comm.Get_rank(), comm.Get_size(), opts)
            self.groups[members] = pg
        return pg

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

    def forget(self, members: tuple[int, ...]) -> None:
        """Drop the member set's communicator, group and layout after a collective on them
        was abandoned at its deadline (still pending: they must not carry another sync). The
        torch group is aborted, which releases a transfer stuck in it; the MPI communicator
        is left unfreed (freeing one with a pending request is erroneous)."""
        self.cache.pop(members, None)
        self.layouts.pop(members, None)
        pg = self.groups.pop(members, None)
        if pg is not None and hasattr(pg, "abort"):
            pg.abort()

    def close(self) -> None:
        """Tear the torch groups down before the stores (a group alive at interpreter exit
        aborts the process)."""
        self.groups.clear()
        self.stores.clear()
        self._master = None
        _open.discard(self)


_open: weakref.WeakSet[SyncChannels] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for ch in list(_open):
        ch.close()


def _bcast_bytes(channels: SyncChannels, members: tuple[int, ...], comm: MPI.Comm, flat: torch.Tensor,
                 bucket_bytes: int, root: int, dl: Deadline) -> None:
    if channels.backend == "mpi":
        # one broadcast of the whole stream (in < 2 GiB pieces: MPI counts are ints): MPICH
        # pipelines a large broadcast itself (scatter + ring allgather), while each blocking
        # bucket is a synchronising collective of its own, measured 1.25-1.5x a single Bcast
        arr = flat.numpy()
        for start in range(0, arr.size, MPI_CHUNK):
            deadline.bcast(comm, arr[start:start + MPI_CHUNK], root, dl, "the transfer")
        return
    pg = channels.group(members)
    works = []
    for start in range(0, flat.numel(), bucket_bytes):
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = root
        works.append(pg.broadcast([flat[start:start + bucket_bytes]], opts))
    deadline.wait_works(works, dl, "the transfer")


def receiver_grace(timeout_s: float) -> float:
    """Receivers wait this much longer than the sender, so that where the sender is alive it
    gives up first: its report frees its trainer group for the checkpoint that follows."""
    return min(0.25 * timeout_s, 30.0) if timeout_s > 0 else 0.0


def broadcast_weights(channels: SyncChannels, members: tuple[int, ...],
                      named: dict[str, torch.Tensor] | None, version: int, bucket_bytes: int,
                      packed: np.ndarray | torch.Tensor | None = None, wire: torch.dtype | None = None,
                      on_rendezvous=lambda: None) -> tuple[int, dict[str, torch.Tensor]]:
    """Collective over the member set `members` (world ranks; members[0] is the root and
    passes its tensors, the others receive). Returns (version, tensors).

    Receivers get views into their staging buffer (valid until their next sync: load them
    into the engine before that). `packed` (root only): `named` already laid out in header
    order, broadcast in place. `wire`: dtype floating tensors travel in (e.g. bfloat16 on
    GPUs); None keeps theirs. `on_rendezvous()` runs once every member is there
    (accounting: waiting vs transferring). CollectiveTimeout when the sync is not done
    `channels.timeout_s` after it began (receivers: plus `receiver_grace`); the member set is
    then forgotten.
    """
    dl = Deadline(channels.timeout_s + (0 if channels.world.Get_rank() == members[0] else
                                        receiver_grace(channels.timeout_s)),
                  f"weight sync over ranks {list(members)}")
    try:
        return _broadcast(channels, members, named, bucket_bytes, packed, wire, on_rendezvous, version, dl)
    except deadline.CollectiveTimeout:
        channels.forget(members)
        raise


def _broadcast(channels, members, named, bucket_bytes, packed, wire, on_rendezvous, version,
               dl: Deadline) -> tuple[int, dict[str, torch.Tensor]]:
    comm = channels.get(members, dl)
    is_root = comm.Get_rank() == 0
    header = _rendezvous(channels, members, comm, _header(named, version, wire) if is_root else None, dl)
    on_rendezvous()
    if is_root and packed is not None and wire is None and packed.nbytes == header.total:
        flat = torch.as_tensor(packed).to(channels.device)    # no copy where it already lives
    else:
        flat = channels.staging(header.total)
        if is_root:
            _pack(named, header, flat)
    _bcast_bytes(channels, members, comm, flat, bucket_bytes, 0, dl)
    if is_root:
        return header.version, named
    return header.version, channels.views(header, flat)


def _rendezvous(channels: SyncChannels, members: tuple[int, ...], comm: MPI.Comm,
                header: Header | None, dl: Deadline) -> Header:
    """The header from the root, waited for without spinning. A member set that already
    carried this layout (same names, dtypes, shapes) gets one 24-byte allreduce (version, a
    changed flag, the pickled layout's length: the root's values, zeros from the others), not
    the pickled layout: one round of back-off wake-ups, not two, on every sync after the
    first. An allreduce, not a broadcast, so that it completes on no member, the root
    included, before every member has joined."""
    layout = None if header is None else replace(header, version=0)
    meta = np.zeros(3, dtype=np.int64)
    payload = None
    if header is not None:
        changed = channels.layouts.get(members) != layout
        payload = np.frombuffer(pickle.dumps(layout), dtype=np.uint8) if changed else None
        meta[:] = (header.version, changed, 0 if payload is None else payload.size)
    deadline.allreduce_sum(comm, meta, dl, "the rendezvous (every member joining)")
    if meta[1]:
        if payload is None:
            payload = np.empty(int(meta[2]), dtype=np.uint8)
        deadline.bcast(comm, payload, 0, dl, "the layout")
        channels.layouts[members] = layout if header is not None else pickle.loads(payload.tobytes())
    return replace(channels.layouts[members], version=int(meta[0]))
