"""Wake-ups without polling: one byte on a socket per message between the orchestrator and a worker.

A rank that waits for an MPI message otherwise polls (`Iprobe` and a back-off sleep,
flexmarl_hpc.runtime.comm). That costs little CPU of its own, but on a node whose cores are full
every wake-up preempts a rank that computes: `bench/bench_cores.py --pollers` measures
0.20-0.27 of a core per waiting rank taken from two or three ranks generating on 2 cores.
A local run has 4+ waiting ranks on 2 cores most of the time, so the waiting is a large
part of what flex mode's overlap costs there.

With a doorbell a waiting rank sleeps in the kernel (epoll on its sockets) until the sender
rings: the sender posts the MPI message first (non-blocking), then writes one byte on the
TCP socket it shares with the receiver. Woken, the receiver polls MPI with back-off for at
most `GRACE_S` (the message was posted before the ring, so it shows at once; the grace
covers a ring whose message an earlier poll already took). MPI carries every message; the
sockets carry only wake-ups, so a lost or stale ring costs latency, never a message, and a
wait still looks at MPI every `SAFETY_S` without any ring.

The sockets form a star around the orchestrator (`connect`, collective over the world):
one per worker rank. Commands ring the worker, replies ring the orchestrator; collectives
among workers (weight broadcasts, trainer groups) keep polling, their waits are short.
"""
from __future__ import annotations

import selectors
import socket
from typing import TYPE_CHECKING

from flexmarl_hpc.clock import REAL

if TYPE_CHECKING:
    from mpi4py import MPI

GRACE_S = 2e-3
"""Seconds a woken rank polls MPI for the message its ring announced before sleeping again."""
SAFETY_S = 0.05
"""Longest sleep without a ring: a wait looks at MPI at least this often whatever happens."""
CONNECT_TIMEOUT_S = 60.0
"""How long the star may take to form before the run falls back to polling."""


class Doorbell:
    """One rank's end of the star: `peers` maps a peer rank to the connected socket (the
    orchestrator holds one per worker, a worker one to the orchestrator)."""

    def __init__(self, peers: dict[int, socket.socket]) -> None:
        self.peers = peers
        self.selector = selectors.DefaultSelector()          # epoll: no FD_SETSIZE limit
        for rank, s in peers.items():
            s.setblocking(False)
            if s.family in (socket.AF_INET, socket.AF_INET6):   # a ring is one byte: send it now
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.selector.register(s, selectors.EVENT_READ, rank)

    def ring(self, peer: int) -> None:
        """Wake `peer` (after posting the MPI message it is to look for)."""
        s = self.peers.get(peer)
        if s is None:
            return
        try:
            s.send(b"\x01")
        except BlockingIOError:
            pass                    # its buffer is full of unread rings: it wakes anyway
        except OSError:
            self._drop(s)           # the peer has ended: nobody to wake

    def sleep(self, timeout: float) -> bool:
        """Block until a peer rings (True) or `timeout` seconds pass (False); the rings are
        consumed."""
        events = self.selector.select(max(timeout, 0.0))
        for key, _ in events:
            self._drain(key.fileobj)
        return bool(events)

    def close(self) -> None:
        for s in list(self.peers.values()):
            self._drop(s)
        self.selector.close()

    def _drain(self, s: socket.socket) -> None:
        while True:
            try:
                data = s.recv(4096)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:            # closed by the peer: unregister, or epoll reports it forever
                self._drop(s)
                return

    def _drop(self, s: socket.socket) -> None:
        try:
            self.selector.unregister(s)
        except (KeyError, ValueError):
            pass
        self.peers = {r: p for r, p in self.peers.items() if p is not s}
        s.close()


def connect(world: MPI.Comm, root: int = 0) -> Doorbell | None:
    """Collective over `world`: this rank's Doorbell on a star of its own (`connect_star`),
    or None on every rank if any connection failed (the run then polls)."""
    peers = connect_star(world, root)
    return None if peers is None else Doorbell(peers)


def connect_star(world: MPI.Comm, root: int = 0) -> dict[int, socket.socket] | None:
    """Collective over `world`: connect every rank to `root` by TCP. Returns this rank's
    sockets by peer rank (root: one per other rank; the others: one to root), or None on
    every rank if any connection failed. On one node the sockets use the loopback; across
    nodes `root`'s host name. Also the liveness star (flexmarl_hpc.runtime.liveness)."""
    from mpi4py import MPI         # here: runtime/backoff.py imports this module, MPI-free
    rank, size = world.Get_rank(), world.Get_size()
    names = world.allgather(MPI.Get_processor_name())
    host = "127.0.0.1" if len(set(names)) == 1 else socket.gethostname()
    server = None
    address = None
    if rank == root:
        try:
            server = socket.create_server(("127.0.0.1" if host == "127.0.0.1" else "", 0),
                                          backlog=min(size, socket.SOMAXCONN))
            address = (host, server.getsockname()[1])
        except OSError:
            address = None
    address = world.bcast(address, root)
    if address is None:
        return None
    peers: dict[int, socket.socket] = {}
    ok = 1
    if rank != root:
        try:
            s = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
            s.sendall(rank.to_bytes(4, "little"))
            peers[root] = s
        except OSError:
            ok = 0
    else:
        server.settimeout(CONNECT_TIMEOUT_S)
        deadline = REAL.monotonic() + CONNECT_TIMEOUT_S
        try:
            while len(peers) < size - 1 and REAL.monotonic() < deadline:
                s, _ = server.accept()
                s.settimeout(CONNECT_TIMEOUT_S)
                peers[int.from_bytes(_recv_exact(s, 4), "little")] = s
        except OSError:
            pass
        ok = int(len(peers) == size - 1)
        server.close()
    if not world.allreduce(ok, op=MPI.MIN):
        for s in peers.values():
            s.close()
        return None
    return peers


def _recv_exact(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise OSError("the peer closed before sending its rank")
        data += chunk
    return data
