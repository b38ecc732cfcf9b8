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


def _pack(named: dict[str, torch.Tensor]) -> tuple[Header, np.ndarray]:
    names = tuple(named)
    ts = [named[n].detach().contiguous().cpu() for n in names]
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in ts]) if ts else torch.empty(0, dtype=torch.uint8)
    header = Header(-1, names, tuple(str(t.dtype).removeprefix("torch.") for t in ts),
                    tuple(tuple(t.shape) for t in ts), tuple(t.numel() * t.element_size() for t in ts))
    return header, flat.numpy()


def _unpack(header: Header, buf: np.ndarray) -> dict[str, torch.Tensor]:
    out, off = {}, 0
    raw = torch.from_numpy(buf)
    for name, dt, shape, nb in zip(header.names, header.dtypes, header.shapes, header.nbytes):
        out[name] = raw[off:off + nb].view(getattr(torch, dt)).reshape(shape).clone()
        off += nb
    return out


def broadcast_weights(comm: MPI.Comm, named: dict[str, torch.Tensor] | None, version: int,
                      bucket_bytes: int, root: int = 0) -> tuple[int, dict[str, torch.Tensor]]:
    """Collective over `comm`: root passes its tensors, the others receive. Returns (version, tensors)."""
    if comm.Get_rank() == root:
        header, flat = _pack(named)
        header = Header(version, header.names, header.dtypes, header.shapes, header.nbytes)
    else:
        header, flat = None, None
    header = C.bcast_obj(comm, header, root)
    total = sum(header.nbytes)
    if comm.Get_rank() != root:
        flat = np.empty(total, dtype=np.uint8)
    for start in range(0, total, bucket_bytes):
        C.bcast_buffer(comm, flat[start:start + bucket_bytes], root)
    if comm.Get_rank() == root:
        return header.version, named
    return header.version, _unpack(header, flat)
