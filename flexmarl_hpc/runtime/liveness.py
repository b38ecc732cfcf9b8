"""Liveness: a worker learns within a second that the orchestrator has ended, and the
orchestrator that a worker has, whatever launched them.

    live = liveness.connect(world)       # collective, every rank (run.py, after MPI_Init)
    live.watch(on_lost)                  # a daemon thread calls on_lost(rank) when a peer ends
    live.expect(rank) / live.disarm()    # that peer's end (every peer's) is a clean stop now

Why: under mpiexec a rank killed by SIGKILL (the OOM killer, a node failure) ends every
rank at once, but under Slurm the job's het step runs without `--kill-on-bad-exit`
(docs/slurm.md: the preemption exit race), and a killed rank cannot call MPI_Abort. The
other ranks then wait: workers for a command that never comes, the orchestrator for a
reply until run.worker_timeout (1800 s by default).

How: a star of TCP sockets between rank 0 and every other rank (doorbell.connect_star),
separate from the doorbell's, so `run.idle_wait: poll` has it too. The sockets carry no
data. When a process ends, for any reason, the kernel closes its sockets and the peer reads
EOF (or a reset) at once; a node that vanishes without closing them is found by TCP
keepalive (`KEEPALIVE`: idle 5 s, then 3 probes 2 s apart, ~11 s). The watching thread
sleeps in epoll on the sockets: no wake-ups, no CPU, while everyone lives.

What the ranks do with it: a worker that loses the orchestrator prints one line and exits
`EXIT_REQUEUE` (75, requeue: the run resumes from its checkpoints and the store), see
`exit_on_lost`; the orchestrator's transport (runtime/transport.py) turns a lost worker
into `WorkerLost`, and the orchestrator takes its hung-worker path (checkpoint what still
answers, flush the store, exit 75).

Rank 0's main thread can itself be stuck when a worker dies: an isend to the dead rank
made MPICH's libfabric provider retry its connection to the peer forever (seen under Slurm
in about one replica kill of four; the stack: PMPI_Isend -> libfabric -> connect). So a loss
nobody has taken (`take_lost`) within `TAKE_GRACE_S` runs `on_untaken` on the watching
thread: run.py logs the loss and exits 75 there, as a SIGKILLed rank 0 would (every store
write is journaled; the run resumes from its checkpoints and the store).
"""
from __future__ import annotations

import os
import selectors
import socket
import sys
import threading
from typing import Callable

from mpi4py import MPI

from flexmarl_hpc.runtime import requeue
from flexmarl_hpc.runtime.doorbell import connect_star
from flexmarl_hpc.runtime.requeue import EXIT_REQUEUE

TAKE_GRACE_S = 10.0
"""Rank 0: seconds a worker's loss may wait for the main thread (which looks every 0.5 s
while it waits for replies) before `Liveness.on_untaken` runs."""
KEEPALIVE = (5, 2, 3)
"""TCP keepalive (idle s, interval s, probes): a silent dead peer is found in ~11 s."""


class Liveness:
    """One rank's end of the liveness star: `peers` maps a peer rank to its socket."""

    def __init__(self, peers: dict[int, socket.socket]) -> None:
        self.peers = peers
        self.expected: set[int] = set()
        self.armed = True
        self.lost: list[int] = []
        self.dead: set[int] = set()
        """Every peer seen to end unexpectedly, taken or not: no MPI call may touch them."""
        self.taken = False
        self.on_untaken: Callable[[int], None] | None = None
        """Rank 0: called on the watching thread with a lost rank that nobody has taken in
        TAKE_GRACE_S (the main thread is stuck); None: nothing happens."""
        self._lock = threading.Lock()
        self.selector = selectors.DefaultSelector()
        for rank, s in peers.items():
            s.setblocking(False)
            if s.family in (socket.AF_INET, socket.AF_INET6):     # TCP (tests use socket pairs)
                _keepalive(s)
            self.selector.register(s, selectors.EVENT_READ, rank)

    def watch(self, on_lost: Callable[[int], None] | None = None) -> None:
        """Start the thread; `on_lost(rank)` runs on it for each peer that ends unexpectedly
        (default: record it for `take_lost`)."""
        threading.Thread(target=self._loop, args=(on_lost or self._record,), name="liveness",
                         daemon=True).start()

    def expect(self, rank: int) -> None:
        """`rank` is stopping cleanly: its end is no loss."""
        with self._lock:
            self.expected.add(rank)

    def disarm(self) -> None:
        """The whole run is stopping cleanly: no end is a loss any more."""
        self.armed = False

    def take_lost(self) -> int | None:
        """A peer that ended unexpectedly (each once), or None. Taking one says the caller
        handles the failure: no `on_untaken` runs after it."""
        with self._lock:
            while self.lost:
                rank = self.lost.pop(0)
                if self.armed and rank not in self.expected:
                    self.taken = True
                    return rank
        return None

    def ended(self, rank: int) -> bool:
        """`rank` has ended unexpectedly (taken or not: this does not consume it). Sends to
        it, and tests of sends to it, are skipped: either can hang in the MPI library."""
        with self._lock:
            return rank in self.dead

    def _record(self, rank: int) -> None:
        with self._lock:
            self.lost.append(rank)
            self.dead.add(rank)
        timer = threading.Timer(TAKE_GRACE_S, self._untaken, (rank,))
        timer.daemon = True
        timer.start()

    def _untaken(self, rank: int) -> None:
        with self._lock:
            stuck = (not self.taken and self.armed and rank in self.lost and rank not in self.expected)
        if stuck and self.on_untaken is not None:
            self.on_untaken(rank)

    def _loop(self, on_lost: Callable[[int], None]) -> None:
        while self.selector.get_map():
            for key, _ in self.selector.select(None):
                if self._ended(key.fileobj):
                    self.selector.unregister(key.fileobj)
                    with self._lock:
                        expected = not self.armed or key.data in self.expected
                    if not expected:
                        on_lost(key.data)

    @staticmethod
    def _ended(s: socket.socket) -> bool:
        try:
            return not s.recv(64)       # EOF: the peer process is gone (nothing else is sent)
        except BlockingIOError:
            return False
        except OSError:                 # reset, or keepalive gave up: gone too
            return True


def peer_ended(live: Liveness | None, rank: int) -> bool:
    """`rank` is known to have ended (`Liveness.ended`); False without a liveness star. The
    senders to workers (runtime/transport.py, ranks/tool_ranks.py) skip such a rank's sends and
    tests of them: either can hang in the MPI library."""
    return live is not None and live.ended(rank)


def _keepalive(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = KEEPALIVE
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
        if hasattr(socket, name):       # Linux; elsewhere the system's (slower) defaults
            s.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def connect(world: MPI.Comm, root: int = 0) -> Liveness | None:
    """Collective over `world`: this rank's end of the liveness star, or None on every rank
    when the sockets cannot be opened (then a dead rank is found by run.worker_timeout only)."""
    peers = connect_star(world, root)
    return None if peers is None else Liveness(peers)


def exit_on_lost(rank: int) -> Callable[[int], None]:
    """A worker's `on_lost`: one line saying why, then exit EXIT_REQUEUE at once (the main
    thread is waiting for a command that will never come, maybe inside MPI)."""
    def lost(peer: int) -> None:
        sys.stderr.write(f"[rank {rank}] the orchestrator (rank {peer}) has ended (its liveness "
                         f"socket closed): exiting {EXIT_REQUEUE}; the run resumes when requeued or "
                         "resubmitted\n")
        sys.stderr.flush()
        sys.stdout.flush()
        requeue.mark(f"the orchestrator (rank {peer}) was lost")
        os._exit(EXIT_REQUEUE)
    return lost
