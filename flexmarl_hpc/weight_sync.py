"""Bucketed weight broadcast from a trainer group's leader to the replicas serving an agent.

The leader packs the HF-named tensors into one byte stream and broadcasts it in fixed-size
buckets over a communicator holding {leader} + {target replicas} (built once per member
set with `MPI_Comm_create_group`, which only the members call, and cached). A header
(version, names, dtypes, shapes) goes first. Receivers land every bucket in a staging
buffer and only then build tensors, so a replica never sees a half-updated model.
The orchestrator issues syncs in one global order, so every member meets the collective
calls in the same sequence and concurrent syncs cannot deadlock.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

from . import comm as C


class SyncChannels:
    """Cache of broadcast communicators keyed by (leader, replicas...) world ranks."""

    def __init__(self, world: MPI.Comm):
        self.world = world
        self.cache: dict[tuple[int, ...], MPI.Comm] = {}
        self.buffers: dict[tuple[int, ...], np.ndarray] = {}

    def buffer(self, members: tuple[int, ...], nbytes: int) -> np.ndarray:
        """A staging buffer reused across syncs of one channel (no allocation, no page faults)."""
        buf = self.buffers.get(members)
        if buf is None or buf.size < nbytes:
            buf = self.buffers[members] = np.empty(nbytes, dtype=np.uint8)
        return buf[:nbytes]

    def get(self, members: tuple[int, ...]) -> MPI.Comm:
        comm = self.cache.get(members)
        if comm is None:
            group = self.world.Get_group().Incl(list(members))
            # tag: a stable function of the member set so concurrent creations don't mix
            tag = hash(members) & 0x7FFF
            comm = self.world.Create_group(group, tag)
            group.Free()
            self.cache[members] = comm
        return comm


@dataclass(frozen=True)
class Header:
    version: int
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    nbytes: tuple[int, ...]
    offsets: tuple[int, ...]           # 16-byte aligned, so every dtype can be viewed in place
    total: int


def _header(named: dict[str, torch.Tensor], version: int) -> Header:
    ts = list(named.values())
    nbytes = tuple(t.numel() * t.element_size() for t in ts)
    offsets, off = [], 0
    for nb in nbytes:
        offsets.append(off)
        off += -(-nb // 16) * 16
    return Header(version, tuple(named), tuple(str(t.dtype).removeprefix("torch.") for t in ts),
                  tuple(tuple(t.shape) for t in ts), nbytes, tuple(offsets), off)


def _pack(named: dict[str, torch.Tensor], header: Header, out: np.ndarray) -> None:
    flat = torch.from_numpy(out)
    for t, nb, off in zip(named.values(), header.nbytes, header.offsets):
        flat[off:off + nb].copy_(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8))


def _unpack(header: Header, buf: np.ndarray) -> dict[str, torch.Tensor]:
    raw = torch.from_numpy(buf)
    # views into the freshly received buffer: no copy (the buffer belongs to this transfer)
    return {name: raw[off:off + nb].view(getattr(torch, dt)).reshape(shape)
            for name, dt, shape, nb, off in zip(header.names, header.dtypes, header.shapes,
                                                header.nbytes, header.offsets)}


def broadcast_weights(comm: MPI.Comm, named: dict[str, torch.Tensor] | None, version: int,
                      bucket_bytes: int, root: int = 0,
                      staging=lambda nbytes: np.empty(nbytes, dtype=np.uint8),
                      packed: np.ndarray | None = None,
                      on_rendezvous=lambda: None) -> tuple[int, dict[str, torch.Tensor]]:
    """Collective over `comm`: root passes its tensors, the others receive. Returns (version, tensors).

    `staging(nbytes)` gives the byte buffer to pack into / receive into (SyncChannels.buffer
    reuses one per channel); received tensors are views into it, valid until the next sync
    on the same buffer: load them into the model before that (engines copy on load).
    `packed` (root only): `named` already laid out in header order, broadcast as is.
    `on_rendezvous()` runs once every member is there (accounting: waiting vs transferring).
    """
    is_root = comm.Get_rank() == root
    header = _header(named, version) if is_root else None
    # The header is the rendezvous: members arrive at different times, so it is waited for
    # without spinning. Once it is through, every member is here and the buckets stream with
    # blocking Bcast: MPICH only progresses a non-blocking collective inside Test/Wait, so
    # a sleeping poll would stall the pipeline of a large broadcast.
    header = C.bcast_obj(comm, header, root)
    on_rendezvous()
    if is_root and packed is not None and packed.size == header.total:
        flat = packed
    else:
        flat = staging(header.total)
        if is_root:
            _pack(named, header, flat)
    for start in range(0, flat.size, bucket_bytes):
        comm.Bcast(flat[start:start + bucket_bytes], root)
    if is_root:
        return header.version, named
    return header.version, _unpack(header, flat)
