"""Location-agnostic training-state transfer (agent-centric trainer allocation).

An agent's training state (model + optimizer + RNG, as `TrainerBackend.state()` named
tensors) lives at a `Location`: on the accelerator of a trainer group (`resident`, a live
trainer object) or parked in the host memory of a group's ranks. One call moves it
between any two locations, and every rank of the source and destination groups makes the
same call:

    mover.move(agent, src=Location(group=1, resident=False), dst=Location(group=0, resident=True))

Same group: device <-> host copy. Different groups: rank i of the source group sends its
shard to rank i of the destination group over MPI (one header + one flat byte buffer, a
non-blocking send/receive waited for without spinning). The caller does not care which.
Swapping out frees the device copy; swapping in rebuilds the trainer and loads the state,
bit for bit (tests/test_state_swap.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from mpi4py import MPI

from . import comm as C
from .weight_sync import _header, _pack, _unpack


@dataclass(frozen=True)
class Location:
    group: int
    """Trainer group whose ranks hold the state."""
    resident: bool
    """True: live on the group's device as a trainer; False: parked in the group's host memory."""


def to_host(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A host copy of a state (pinned when CUDA is there, so the copy back is asynchronous)."""
    pin = torch.cuda.is_available()
    out = {}
    for k, v in state.items():
        h = v.detach().to("cpu", copy=True)
        out[k] = h.pin_memory() if pin else h
    return out


def send_state(world: MPI.Comm, state: dict[str, torch.Tensor], dest: int) -> None:
    header = _header(state, 0)
    flat = np.empty(header.total, dtype=np.uint8)
    _pack(state, header, flat)
    C.wait(world.isend(header, dest=dest, tag=C.TAG_STATE))
    C.wait(world.Isend(flat, dest=dest, tag=C.TAG_STATE))


def recv_state(world: MPI.Comm, source: int) -> dict[str, torch.Tensor]:
    header = C.recv(world, source=source, tag=C.TAG_STATE)
    flat = np.empty(header.total, dtype=np.uint8)
    C.wait(world.Irecv(flat, source=source, tag=C.TAG_STATE))
    return {k: v.clone() for k, v in _unpack(header, flat).items()}


class StateMover:
    """Runs on one rank of a trainer group; `trainers` are its live (resident) agents."""

    def __init__(self, world: MPI.Comm, group_comm: MPI.Comm, my_group: int,
                 group_ranks: Callable[[int], list[int]], trainers: dict,
                 build: Callable[[str], object]):
        self.world, self.group_comm, self.my_group = world, group_comm, my_group
        self.group_ranks = group_ranks
        self.trainers = trainers            # agent -> live TrainerBackend
        self.parked: dict[str, dict[str, torch.Tensor]] = {}
        self.build = build                  # agent -> fresh TrainerBackend (weights overwritten)

    def holds(self, agent: str) -> bool:
        return agent in self.trainers or agent in self.parked

    def state_of(self, agent: str) -> dict[str, torch.Tensor]:
        """The state wherever it is on this rank (live or parked), without moving it."""
        if agent in self.trainers:
            return self.trainers[agent].state()
        return self.parked[agent]

    def move(self, agent: str, src: Location, dst: Location) -> None:
        me = self.group_comm.Get_rank()
        state = None
        if src.group == self.my_group:
            if src.resident:
                state = to_host(self.trainers.pop(agent).state())   # frees the device copy
            else:
                state = self.parked.pop(agent)
            if dst.group != self.my_group:
                send_state(self.world, state, self.group_ranks(dst.group)[me])
                state = None
        if dst.group == self.my_group:
            if state is None:
                state = recv_state(self.world, self.group_ranks(src.group)[me])
            if dst.resident:
                tr = self.build(agent)
                tr.load_state(state)
                self.trainers[agent] = tr
            else:
                self.parked[agent] = state
