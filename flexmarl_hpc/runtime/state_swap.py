"""Location-agnostic training-state transfer (agent-centric trainer allocation).

An agent's training state (model + optimizer + RNG) lives at a `Location`: on the
accelerator of a trainer group (`resident`, a live trainer object) or parked in the host
memory of a group's ranks. One call moves it between any two locations, and every rank of
the source and destination groups makes the same call:

    mover.move(agent, src=Location(group=1, resident=False), dst=Location(group=0, resident=True))

Same group, a trainer with the `Swappable` interface: swap-out copies this rank's own
parameters, grads and optimizer state into preallocated host buffers (`HostBuffers`: one
tensor per name, allocated at the first swap and reused by every later one, pinned when
CUDA is there, filled with non-blocking copies), points the module and optimizer at those
host copies and frees the device memory; swap-in copies them back onto the device. The
module, the optimizer and the host buffers are kept: nothing is rebuilt, no checkpoint is
read. Both backends have it: TorchTrainer re-points its tensors at the host copies (its
`state()` reads them there); MegatronTrainer (trainer/megatron/swap.py) copies every storage
of its shards out and resizes it to 0 bytes, so the many views megatron keeps stay valid,
and brings the state in for a `state()`/checkpoint call while parked (and for a weight
sync's stream, ranks/workers.py).

Different groups, shard to shard: a trainer with the `ShardMovable` interface (megatron)
sends its rank's own storages, rank i to rank i of the destination group. The source sends
a `MoveHeader` (its layout key, each storage's name and size, version, RNG, its reshard key);
the destination builds the agent's trainer, and where its key equals the sender's and its
storages have the same names and sizes, the source offloads (if resident) and the bytes are
received straight into one host allocation and adopted (onload when resident, shelved when
parked; the allocation stays as the agent's host buffers, like a local swap's). Gradient
storages are not sent: zero between optimizer steps (checked at the source), zeroed at the
destination. Same key, other storages: one error naming the agent and the first difference
(same-layout builds are deterministic, so that is a bug, never silent).

Different groups, another TP/PP/DP of the same model (`Reshardable`, the destination answers
RESHARD): every rank of both groups learns every rank's `reshard.Block`s (megatron-core's
global coordinates of its parameters, fp32 main params and Adam moments), computes the same
`reshard.plan`, and each source rank sends one packed message per destination rank, received
into the fresh build's tensors: each rank receives its own shard, each byte once.

Different groups, the fallback (another model or precision, the destination answers FALLBACK;
trainers without `ShardMovable`: torch, or a plain parked state): rank i sends its `state()`
to rank i of the destination (one header + one flat byte buffer, a non-blocking
send/receive waited for without spinning). For megatron `state()` gathers the full HF state
(fp32 weights and both Adam moments) and broadcasts it to every rank of the source group,
so every rank of both groups holds the whole state at once, plus its flat copy. The costs
of the paths, measured and at 32B: docs/backends.md. Trainers without `Swappable` keep the
old path everywhere: parked as a host copy of `state()`, rebuilt and loaded on swap-in. Bit
for bit either way (tests/unit/test_state_swap.py; rank to rank tests/mpi/test_state_swap_mpi.py;
megatron group to group tests/mpi/mpi_megatron_move.py, resharded tests/mpi/mpi_megatron_reshard.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, MutableMapping, Protocol, runtime_checkable

import numpy as np
import torch
from mpi4py import MPI

from flexmarl_hpc.runtime import comm
from flexmarl_hpc.runtime import reshard
from flexmarl_hpc.runtime.messages import Location  # defined there for MPI-free importers; state_swap.Location too
from flexmarl_hpc.runtime.weight_sync import bucket_views, dict_bucket, host_bytes, pack


class HostBuffers:
    """One agent's parked training state on one rank: a host tensor per name, allocated on
    first use and reused by every later swap-out (no allocation per swap); pinned when CUDA
    is available, so the copies in both directions are asynchronous."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.allocations = 0                # how many buffers were ever allocated (tests)
        self.pin = torch.cuda.is_available()

    def copy_in(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """`t` copied (non-blocking) into the buffer `name`; returns the buffer."""
        buf = self.buffers.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            # the weight sync's host allocator: huge pages, or pinned where CUDA is there
            raw = host_bytes(t.numel() * t.element_size(), pin=self.pin)
            buf = raw.view(t.dtype).view(t.shape) if t.numel() else torch.empty(t.shape, dtype=t.dtype)
            self.buffers[name] = buf
            self.allocations += 1
        buf.copy_(t.detach(), non_blocking=True)
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fresh device copy of host tensor `t` (non-blocking from pinned memory). Always a
    copy, also on CPU, so the host buffer stays the parked copy and CPU runs the same path."""
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    out.copy_(t, non_blocking=True)
    return out


def finish_copies(device: torch.device) -> None:
    """Wait for the non-blocking copies to/from `device` (before a source is freed)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def release(device: torch.device) -> None:
    """Hand the device memory the dropped tensors held back to the driver."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


@runtime_checkable
class Swappable(Protocol):
    """What a trainer implements so a swap keeps its module and optimizer."""

    def offload(self, host: HostBuffers) -> None:
        """Copy this rank's own parameters, grads and optimizer state (its shards, with
        model parallelism) into `host` and point the module and optimizer at those copies;
        free the device memory. `state()`/`load_state()` keep working while offloaded."""

    def onload(self) -> None:
        """Inverse of `offload`: copy back onto the trainer's device, no rebuild, no reads."""


@runtime_checkable
class ShardMovable(Swappable, Protocol):
    """A `Swappable` trainer whose host buffers move between groups of one layout as they
    are (trainer/megatron/swap.py)."""

    version: int

    def shard_key(self) -> tuple:
        """Equal on two ranks exactly when one's storages can take the other's bytes."""

    def move_sizes(self) -> list[tuple[str, int]]:
        """[(name, bytes)] `shards_out` will send, without offloading."""

    def move_rng(self) -> torch.Tensor:
        """The RNG state that moves with the agent."""

    def shards_out(self, host: HostBuffers) -> tuple[HostBuffers, list[tuple[str, int]], torch.Tensor]:
        """Offload (if resident); (its host buffers, [(name, bytes)] to send, RNG state)."""

    def shard_sizes(self) -> list[tuple[str, int]]:
        """[(name, bytes)] a fresh build's `adopt` takes, in order."""

    def adopt(self, host: HostBuffers, rng: torch.Tensor, version: int) -> None:
        """The bytes in `host` become this fresh build's parked (offloaded) state."""


@runtime_checkable
class Reshardable(ShardMovable, Protocol):
    """A `ShardMovable` trainer whose state moves to a group of another TP/PP/DP layout by
    the pieces of runtime/reshard.py's plan (trainer/megatron/swap.py)."""

    def reshard_key(self) -> tuple:
        """Equal on two groups whose states reshard into each other."""

    def reshard_out(self, agent: str) -> tuple[list[reshard.Block], list[torch.Tensor], float]:
        """Source, resident: (its blocks, the flat tensors they index, Adam step count)."""

    def reshard_in(self) -> tuple[list[reshard.Block], list[torch.Tensor]]:
        """Destination, a fresh build: (its blocks, the flat tensors to receive into)."""

    def reshard_done(self, step: float, rng: torch.Tensor, version: int) -> None:
        """After the pieces are in."""


FALLBACK = "state"       # a destination's answer: other layout, send `state()` instead
RESHARD = "reshard"      # another TP/PP/DP layout of the same model: pieces by reshard.plan


@dataclass(frozen=True)
class MoveHeader:
    """First message of a cross-group move, source rank -> its counterpart."""
    agent: str
    key: tuple | None = None            # the source's shard_key; None: a `state()` follows
    sizes: tuple[tuple[str, int], ...] = ()   # (host buffer name, bytes), in sending order
    version: int = 0
    rng: bytes = b""                    # the source rank's RNG state at the offload
    compat: tuple | None = None         # the source's reshard_key (Reshardable), else None

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.sizes)


def answer_for(head: MoveHeader, key: tuple | None, sizes: list[tuple[str, int]] | None,
               compat: tuple | None = None) -> str:
    """The destination's answer to a shard header: "" (send the shards), RESHARD (another
    layout of the same model: send the plan's pieces), FALLBACK (send `state()`), or an
    error (same layout, other storages)."""
    if key is None or key != head.key:
        return RESHARD if compat is not None and compat == head.compat else FALLBACK
    if list(head.sizes) == sizes:
        return ""
    diff = next((f"{a} != {b}" for a, b in zip(head.sizes, sizes) if a != b),
                f"{len(head.sizes)} storages != {len(sizes)}")
    return (f"state move of agent {head.agent!r}: the source's storages do not match this "
            f"build's ((name, bytes) sent != here: {diff})")


def send_shards(world: MPI.Comm, host: HostBuffers, sizes: list[tuple[str, int]], dest: int) -> None:
    """The host buffers named in `sizes`, one message each, in order (no packing copy)."""
    comm.waitall([world.Isend(host.buffers[n].numpy(), dest=dest, tag=comm.TAG_STATE) for n, _ in sizes])


def recv_shards(world: MPI.Comm, head: MoveHeader, source: int) -> HostBuffers:
    """The shards of `head` received in place into one host allocation (pinned with CUDA):
    the HostBuffers' tensors are views of it, so later swaps on this group reuse it."""
    host = HostBuffers()
    flat = host_bytes(head.nbytes, pin=host.pin)
    host.allocations, off = 1, 0
    for name, n in head.sizes:
        host.buffers[name] = flat[off:off + n]
        off += n
    comm.waitall([world.Irecv(host.buffers[n].numpy(), source=source, tag=comm.TAG_STATE)
                  for n, _ in head.sizes])
    return host


def _index(blocks: list[reshard.Block]) -> dict[tuple, list[reshard.Block]]:
    """A rank's blocks by tensor, so finding a piece's block looks at that tensor's only."""
    out: dict[tuple, list[reshard.Block]] = {}
    for b in blocks:
        out.setdefault(b.tensor, []).append(b)
    return out


def _piece_view(flats: list[torch.Tensor], index: dict, p: reshard.Piece) -> torch.Tensor:
    slot, off, h, w, stride = reshard.locate(index[p.tensor], p.tensor, p.rect)
    t = flats[slot]
    return t.as_strided((h, w), (stride, 1), t.storage_offset() + off)


def _packed(pieces: list[reshard.Piece]) -> tuple[list[int], int]:
    """Each piece's byte offset in a packed message (8-byte aligned: a bf16 piece of odd
    length must not misalign the fp32 piece after it), and the message's size."""
    offs, n = [], 0
    for p in pieces:
        offs.append(n)
        n += -(-p.nbytes // 8) * 8
    return offs, n


def _by_peer(pieces: list[reshard.Piece], me: int, mine: str, peer: str) -> dict[int, list[reshard.Piece]]:
    out: dict[int, list[reshard.Piece]] = {}
    for p in pieces:
        if getattr(p, mine) == me:
            out.setdefault(getattr(p, peer), []).append(p)
    return out


def pack_pieces(pieces: list[reshard.Piece], index: dict, flats: list[torch.Tensor]) -> torch.Tensor:
    """`pieces` (one peer's, in plan order) copied out of `flats` into one message."""
    offs, n = _packed(pieces)
    buf = torch.empty(n, dtype=torch.uint8)
    for p, off in zip(pieces, offs):
        v = _piece_view(flats, index, p)
        buf[off:off + p.nbytes].view(v.dtype).view(v.shape).copy_(v)
    return buf


def unpack_pieces(buf: torch.Tensor, pieces: list[reshard.Piece], index: dict, flats: list[torch.Tensor]) -> None:
    """Inverse of `pack_pieces`: the message's pieces written into `flats`."""
    for p, off in zip(pieces, _packed(pieces)[0]):
        v = _piece_view(flats, index, p)
        v.copy_(buf[off:off + p.nbytes].view(v.dtype).view(v.shape))


def send_pieces(world: MPI.Comm, pieces: list[reshard.Piece], me: int, blocks: list[reshard.Block],
                flats: list[torch.Tensor], to: list[int]) -> int:
    """This source rank's pieces of the plan, one message per destination rank (`to`: world
    ranks of the destination group) packed in plan order; returns the bytes sent."""
    index = _index(blocks)
    bufs = [(d, pack_pieces(mine, index, flats)) for d, mine in _by_peer(pieces, me, "src", "dst").items()]
    comm.waitall([world.Isend(b.numpy(), dest=to[d], tag=comm.TAG_STATE) for d, b in bufs])
    return sum(p.nbytes for p in pieces if p.src == me)


def recv_pieces(world: MPI.Comm, pieces: list[reshard.Piece], me: int, blocks: list[reshard.Block],
                flats: list[torch.Tensor], frm: list[int]) -> int:
    """This destination rank's pieces, one message per source rank (`frm`: world ranks of
    the source group), written into its flat tensors; returns the bytes received (the
    pieces', without the alignment padding)."""
    got, index = _by_peer(pieces, me, "dst", "src"), _index(blocks)
    bufs = {s: torch.empty(_packed(mine)[1], dtype=torch.uint8) for s, mine in got.items()}
    comm.waitall([world.Irecv(bufs[s].numpy(), source=frm[s], tag=comm.TAG_STATE) for s in got])
    for s, mine in got.items():
        unpack_pieces(bufs[s], mine, index, flats)
    return sum(p.nbytes for p in pieces if p.dst == me)


def exchange_blocks(world: MPI.Comm, mine, others: list[int]) -> list:
    """`mine` to every rank of `others` and theirs back (non-blocking sends, then receives)."""
    reqs = [world.isend(mine, dest=r, tag=comm.TAG_STATE) for r in others]
    got = [comm.recv(world, source=r, tag=comm.TAG_STATE) for r in others]
    comm.waitall(reqs)
    return got


def _rng_bytes(rng: torch.Tensor) -> bytes:
    return rng.numpy().tobytes()


def _rng_of(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def to_host(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A host copy of a state (pinned when CUDA is there, so the copy back is asynchronous)."""
    pin = torch.cuda.is_available()
    out = {}
    for k, v in state.items():
        h = v.detach().to("cpu", copy=True)
        out[k] = h.pin_memory() if pin else h
    return out


def send_state(world: MPI.Comm, state: dict[str, torch.Tensor], dest: int) -> None:
    header = dict_bucket(state)
    flat = np.empty(header.total, dtype=np.uint8)
    pack(state, header, flat)
    comm.wait(world.isend(header, dest=dest, tag=comm.TAG_STATE))
    comm.wait(world.Isend(flat, dest=dest, tag=comm.TAG_STATE))


def recv_state(world: MPI.Comm, source: int) -> dict[str, torch.Tensor]:
    header = comm.recv(world, source=source, tag=comm.TAG_STATE)
    flat = np.empty(header.total, dtype=np.uint8)
    comm.wait(world.Irecv(flat, source=source, tag=comm.TAG_STATE))
    return {k: v.clone() for k, v in bucket_views(header, flat).items()}


class Parked(MutableMapping):
    """The agents parked on this rank, as `state()` dicts: a shelved (offloaded) trainer's
    state read from its host buffers, or a plain host copy (trainers without `Swappable`).
    Assigning a state to a shelved agent loads it into the host copies (resume)."""

    def __init__(self) -> None:
        self.shelf: dict[str, Swappable] = {}          # agent -> offloaded trainer
        self.hosts: dict[str, HostBuffers] = {}        # agent -> its preallocated host memory
        self.states: dict[str, dict[str, torch.Tensor]] = {}

    def __getitem__(self, agent: str) -> dict[str, torch.Tensor]:
        if agent in self.shelf:
            return self.shelf[agent].state()
        return self.states[agent]

    def __setitem__(self, agent: str, state: dict[str, torch.Tensor]) -> None:
        if agent in self.shelf:
            self.shelf[agent].load_state(state)
        else:
            self.states[agent] = state

    def __delitem__(self, agent: str) -> None:
        if agent in self.shelf:
            del self.shelf[agent], self.hosts[agent]
        else:
            del self.states[agent]

    def __iter__(self) -> Iterator[str]:
        yield from self.shelf
        yield from self.states

    def __len__(self) -> int:
        return len(self.shelf) + len(self.states)


class StateMover:
    """Runs on one rank of a trainer group; `trainers` are its live (resident) agents."""

    def __init__(self, world: MPI.Comm, group_comm: MPI.Comm, my_group: int,
                 group_ranks: Callable[[int], list[int]], trainers: dict,
                 build: Callable[[str], object]):
        self.world, self.group_comm, self.my_group = world, group_comm, my_group
        self.group_ranks = group_ranks
        self.trainers = trainers            # agent -> live TrainerBackend
        self.parked = Parked()
        self.build = build                  # agent -> fresh TrainerBackend (weights overwritten)

    def holds(self, agent: str) -> bool:
        return agent in self.trainers or agent in self.parked

    def state_of(self, agent: str) -> dict[str, torch.Tensor]:
        """The state wherever it is on this rank (live or parked), without moving it."""
        if agent in self.trainers:
            return self.trainers[agent].state()
        return self.parked[agent]

    def park(self, agent: str, tr) -> None:
        """Swap a live trainer out into this rank's host memory."""
        if isinstance(tr, Swappable):
            host = self.parked.hosts.get(agent) or HostBuffers()
            tr.offload(host)
            self.parked.shelf[agent], self.parked.hosts[agent] = tr, host
        else:
            self.parked.states[agent] = to_host(tr.state())

    def unpark(self, agent: str):
        """Swap a parked agent in: the shelved trainer copied back, else rebuilt + loaded."""
        if agent in self.parked.shelf:
            tr = self.parked.shelf.pop(agent)          # its HostBuffers stay for the next swap
            tr.onload()
            return tr
        tr = self.build(agent)
        tr.load_state(self.parked.states.pop(agent))
        return tr

    def move(self, agent: str, src: Location, dst: Location) -> None:
        if src == dst:
            return
        if src.group == self.my_group and dst.group == self.my_group:    # device <-> host here
            if src.resident:
                self.park(agent, self.trainers.pop(agent))
            else:
                self.trainers[agent] = self.unpark(agent)
        elif src.group == self.my_group:
            peers = self.group_ranks(dst.group)
            self.send(agent, peers[self.group_comm.Get_rank()], peers)
        elif dst.group == self.my_group:
            peers = self.group_ranks(src.group)
            self.receive(agent, dst.resident, peers[self.group_comm.Get_rank()], peers)

    def send(self, agent: str, to: int, peers: list[int] | None = None) -> None:
        """Source side of a cross-group move: this rank's shard if the destination takes it,
        its plan's pieces if the destination's layout differs (`peers`: the destination
        group's world ranks), else its `state()`; the agent leaves this rank (trainer, shelf
        and host memory)."""
        tr = self.trainers.pop(agent, None) or self.parked.shelf.pop(agent, None)
        host = self.parked.hosts.pop(agent, None)
        if isinstance(tr, ShardMovable):
            compat = tr.reshard_key() if isinstance(tr, Reshardable) else None
            comm.wait(self.world.isend(MoveHeader(agent, tr.shard_key(), tuple(tr.move_sizes()), tr.version,
                                                  _rng_bytes(tr.move_rng()), compat), dest=to, tag=comm.TAG_STATE))
            answer = comm.recv(self.world, source=to, tag=comm.TAG_STATE)
            if answer == "":
                host, sizes, _ = tr.shards_out(host or HostBuffers())
                send_shards(self.world, host, sizes, to)
                return
            if answer == RESHARD:
                with tr.onloaded():                  # a parked source: on the device for the pieces
                    blocks, flats, step = tr.reshard_out(agent)
                    srcs, dsts = self._layouts((blocks, step), self.group_ranks(self.my_group), peers or [to])
                    send_pieces(self.world, reshard.plan([b for b, _ in srcs], [b for b, _ in dsts]),
                                self.group_comm.Get_rank(), blocks, flats, peers or [to])
                return
            if answer != FALLBACK:
                raise ValueError(answer)
        else:
            comm.wait(self.world.isend(MoveHeader(agent), dest=to, tag=comm.TAG_STATE))
        # collective over this group (megatron gathers the full state to every rank)
        state = to_host(tr.state()) if tr is not None else self.parked.states.pop(agent)
        send_state(self.world, state, to)

    def _layouts(self, mine, src: list[int], dst: list[int]) -> tuple[list, list]:
        """Every rank of both groups learns every rank's (blocks, step): (the source group's
        in order, the destination group's), to compute the same plan everywhere."""
        me = self.world.Get_rank()
        others = [r for r in [*src, *dst] if r != me]
        got = dict(zip(others, exchange_blocks(self.world, mine, others)))
        got[me] = mine
        return [got[r] for r in src], [got[r] for r in dst]

    def receive(self, agent: str, resident: bool, frm: int, peers: list[int] | None = None) -> None:
        """Destination side: the counterpart's shard adopted by a fresh build, or its state."""
        head = comm.recv(self.world, source=frm, tag=comm.TAG_STATE)
        tr = None
        if head.key is not None:
            tr = self.build(agent)
            same = isinstance(tr, ShardMovable) and tr.shard_key() == head.key
            answer = answer_for(head, head.key if same else None, tr.shard_sizes() if same else None,
                                tr.reshard_key() if isinstance(tr, Reshardable) else None)
            comm.wait(self.world.isend(answer, dest=frm, tag=comm.TAG_STATE))
            if answer not in ("", FALLBACK, RESHARD):
                raise ValueError(answer)
            if answer == RESHARD:
                self.receive_resharded(agent, tr, head, resident, peers or [frm])
                return
            if answer == "":
                host = recv_shards(self.world, head, frm)
                tr.adopt(host, _rng_of(head.rng), head.version)
                self.parked.hosts[agent] = host         # kept for the next swap, as unpark keeps it
                if resident:
                    tr.onload()
                    self.trainers[agent] = tr
                else:                                   # shelved: the received bytes are its parked state
                    self.parked.shelf[agent] = tr
                return
        state = recv_state(self.world, frm)
        if tr is None and not resident:
            self.parked[agent] = state
            return
        tr = tr or self.build(agent)
        tr.load_state(state)
        if resident:
            self.trainers[agent] = tr
        else:
            self.park(agent, tr)

    def receive_resharded(self, agent: str, tr, head: MoveHeader, resident: bool, peers: list[int]) -> None:
        """Destination side of a resharding move: the fresh build `tr` receives the plan's
        pieces (its own shard of parameters, fp32 main params and Adam moments, each byte
        once) straight into its tensors; then the source's step count, RNG and version."""
        blocks, flats = tr.reshard_in()
        srcs, dsts = self._layouts((blocks, None), peers, self.group_ranks(self.my_group))
        recv_pieces(self.world, reshard.plan([b for b, _ in srcs], [b for b, _ in dsts]),
                    self.group_comm.Get_rank(), blocks, flats, peers)
        tr.reshard_done(srcs[0][1], _rng_of(head.rng), head.version)
        if resident:
            self.trainers[agent] = tr
        else:
            self.park(agent, tr)
