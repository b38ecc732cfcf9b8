"""Deadlines on the collectives of a weight sync: a member that never arrives, or a transfer
that stalls, becomes a typed error within `weight_sync.timeout_s` instead of a job that sits
until its wall-clock limit.

    dl = Deadline(timeout_s, what="weight sync over ranks [0, 2]")
    join(world, members, dl, "joining")              # before a member set's communicator exists
    allreduce_sum(comm, meta, dl, "rendezvous")     # MPI: non-blocking collective + Test
    bcast(comm, buf, 0, dl, "transfer")
    wait_works(works, dl, "transfer")               # torch.distributed Work (gloo, nccl)
    # -> CollectiveTimeout once dl has passed; the worker reports it (messages.SyncTimedOut)
    #    and the orchestrator ends the job the hung-worker way: checkpoint, flush, exit 75

Waiting never spins: each look (`Test`, `is_completed`) is followed by a back-off sleep
(backoff.until: 20 us .. 0.5 ms), so a rank waiting for a late member costs its node's cores
nothing. MPICH progresses a non-blocking collective only inside Test; measured here, an
Ibcast waited this way is no slower than a blocking Bcast (`bench/bench_weight_sync.py`, docs/LOG.md 2026-11-25 "hung collectives").
A collective abandoned at its deadline stays pending: its communicator or group must not be
used again (sync_groups.SyncChannels.abandon).

mpi4py is imported by the functions that wait on MPI, never at the top: vLLM's TP workers
wait with `wait_works` / `wait_blocking` and must not load MPI (docs/backends.md#vllm-engines).
"""
from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

from flexmarl_hpc.clock import REAL
from flexmarl_hpc.runtime.backoff import until

if TYPE_CHECKING:
    from mpi4py import MPI


class CollectiveTimeout(TimeoutError):
    """A collective did not complete by its deadline."""

    def __init__(self, what: str, phase: str, timeout_s: float, waited_s: float,
                 field: str = "weight_sync.timeout_s", began: str = "the sync began") -> None:
        self.what, self.phase, self.timeout_s, self.waited_s = what, phase, timeout_s, waited_s
        super().__init__(f"{what}: {phase} not done {waited_s:.1f} s after {began} "
                         f"({field}={timeout_s:g})")


class Deadline:
    """A point in time `timeout_s` from now (0: none, wait forever), for several waits."""

    def __init__(self, timeout_s: float, what: str = "collective", field: str = "weight_sync.timeout_s",
                 began: str = "the sync began") -> None:
        self.timeout_s, self.what = float(timeout_s), what
        self.field, self.began = field, began          # named in the timeout's message
        self.start = REAL.monotonic()

    def left(self) -> float | None:
        """Seconds until the deadline (at least 0), or None without one."""
        if self.timeout_s <= 0:
            return None
        return max(self.start + self.timeout_s - REAL.monotonic(), 0.0)

    def expired(self, phase: str) -> CollectiveTimeout:
        return CollectiveTimeout(self.what, phase, self.timeout_s, REAL.monotonic() - self.start, self.field,
                                 self.began)


def wait_until(ready: Callable[[], bool], dl: Deadline, phase: str) -> None:
    """Return once `ready()`, sleeping between looks; CollectiveTimeout at the deadline."""
    try:
        until(ready, dl.left(), what=phase)
    except TimeoutError:
        raise dl.expired(phase) from None


def wait_request(req: MPI.Request, dl: Deadline, phase: str) -> None:
    wait_until(req.Test, dl, phase)


def wait_requests(reqs: list[MPI.Request], dl: Deadline, phase: str) -> None:
    """Every one of `reqs` by the deadline (left pending at it: see abandon)."""
    from mpi4py import MPI
    wait_until(lambda: MPI.Request.Testall(reqs), dl, phase)


def bcast(comm: MPI.Comm, buf, root: int, dl: Deadline, phase: str) -> None:
    """`comm.Bcast(buf, root)` by the deadline."""
    wait_request(comm.Ibcast(buf, root=root), dl, phase)


def allreduce_sum(comm: MPI.Comm, buf, dl: Deadline, phase: str) -> None:
    """In-place SUM allreduce by the deadline. As a rendezvous it completes only once every
    member has joined (a broadcast may complete at its root while a member is missing)."""
    from mpi4py import MPI
    wait_request(comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM), dl, phase)


def join(world: MPI.Comm, members: tuple[int, ...], dl: Deadline, phase: str) -> None:
    """Return once every rank of `members` (world ranks, root first) is here, by the
    deadline: each other member sends the root a token, the root answers each once all have.
    Ahead of a blocking set-up over the members (MPI_Comm_create_group has no non-blocking
    form, and waits forever for a member that never comes)."""
    from flexmarl_hpc.runtime.comm import TAG_JOIN
    root, me = members[0], world.Get_rank()
    token = np.zeros(1, dtype=np.int8)
    if me == root:
        got = np.zeros(len(members) - 1, dtype=np.int8)
        receive_by([world.Irecv(got[i:i + 1], source=m, tag=TAG_JOIN) for i, m in enumerate(members[1:])],
                    dl, phase)
        reqs = [world.Isend(token, dest=m, tag=TAG_JOIN) for m in members[1:]]
        wait_requests(reqs, dl, phase)                                # 1 byte: sent eagerly
        return
    wait_request(world.Isend(token, dest=root, tag=TAG_JOIN), dl, phase)
    receive_by([world.Irecv(token, source=root, tag=TAG_JOIN)], dl, phase)


def receive_by(reqs: list[MPI.Request], dl: Deadline, phase: str) -> None:
    """MPI requests by the deadline; at it, the ones still open are cancelled (a receive left
    posted would take a late member's token, and MPI_Finalize complains of it)."""
    try:
        wait_requests(reqs, dl, phase)
    except CollectiveTimeout:
        for r in reqs:
            if not r.Test():
                r.Cancel()
                r.Wait()
        raise


def wait_works(works: Iterable, dl: Deadline, phase: str) -> None:
    """Wait for torch.distributed Work objects by the deadline, then `wait()` each, which
    raises the error of a failed one."""
    works = list(works)
    wait_until(lambda: all(w.is_completed() for w in works), dl, phase)
    for w in works:
        w.wait()


def wait_blocking(works: Iterable, dl: Deadline, phase: str) -> None:
    """Wait for torch.distributed Works whose completion is seen only inside `wait()`
    (gloo's send and recv), each with the time left (a condition wait, not a spin); gloo's
    timeout error becomes CollectiveTimeout."""
    for w in works:
        left = dl.left()
        try:
            w.wait() if left is None else w.wait(datetime.timedelta(seconds=max(left, 1e-3)))
        except RuntimeError as e:
            if "imed out" not in str(e) and "imeout" not in str(e):
                raise
            raise dl.expired(phase) from None


def wait_p2p(works: Iterable, backend: str, dl: Deadline, phase: str) -> None:
    """A torch group's send/recv Works by the deadline: gloo's complete only inside `wait()`
    (`wait_blocking`), NCCL's are looked at (`wait_works`)."""
    (wait_blocking if backend == "gloo" else wait_works)(works, dl, phase)
