"""How the orchestrator reaches its workers: a transport object it is given.

`MpiTransport` serves real jobs (the MPI world, passed in, never global); `FakeTransport`
answers from a script, in memory, so unit tests drive the real Orchestrator without MPI.
The simulator's transport (sim/) answers the same messages on a simulated clock.

The worker end of the MPI transport is `recv_command`/`send_reply`: replicas and trainer
leaders keep their communicator for collectives (weight broadcasts, group commands).
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Protocol

from mpi4py import MPI

from flexmarl_hpc.clock import REAL
from flexmarl_hpc.runtime.comm import TAG_CMD, TAG_REPLY, abort, poll, recv, recv_from, wait, waitall
from flexmarl_hpc.runtime import messages
from flexmarl_hpc.runtime.doorbell import Doorbell
from flexmarl_hpc.runtime.liveness import Liveness, peer_ended
from flexmarl_hpc.runtime.messages import WorkerLost  # noqa: F401 (transport.WorkerLost)

LIVENESS_CHECK_S = 0.5
"""How often a waiting orchestrator looks whether a worker has ended (runtime/liveness.py)."""


class Transport(Protocol):
    def send(self, rank: int, msg: messages.Command) -> None:
        """Queue a command to a worker rank; never waits for the worker."""

    def receive(self, timeout: float | None = None) -> tuple[int, messages.Reply]:
        """The next reply as (source rank, message), waiting without a spin. Raises
        TimeoutError after `timeout` seconds (None: wait as long as it takes), WorkerLost
        when a worker has ended while nothing arrives."""

    def poll(self) -> tuple[int, messages.Reply] | None:
        """A reply that has already arrived, or None; never waits."""

    def abort(self, code: int) -> None:
        """End the whole job with `code` (a hung worker cannot be stopped by a message)."""


class MpiTransport:
    """Commands on comm.TAG_CMD, replies on comm.TAG_REPLY of `comm` (the world).

    Sends are non-blocking: a micro-batch is larger than MPI's eager limit, so a blocking
    send to a trainer leader still busy with the previous one waited until that leader next
    looked for a message (seconds of orchestrator time, with every replica's next prompt
    queued behind it). MPI keeps commands to one rank in order; each request is kept until
    it completes (checked at every send and receive; `close` waits for the rest)."""

    def __init__(self, comm: MPI.Comm, bell: Doorbell | None = None, live: Liveness | None = None) -> None:
        self.comm = comm
        self.bell = bell
        self.live = live
        self.sending: list[tuple[int, MPI.Request]] = []

    def send(self, rank: int, msg: messages.Command) -> None:
        if self._dead(rank):
            return                  # an isend to it can hang in MPI (liveness.py); the next
                                    # receive reports the loss
        self._reap()
        self.sending.append((rank, self.comm.isend(messages.encode(msg), dest=rank, tag=TAG_CMD)))
        if self.bell is not None:
            self.bell.ring(rank)

    def receive(self, timeout: float | None = None) -> tuple[int, messages.Reply]:
        if self.live is None:
            return self._receive(timeout)
        # in slices: between them, a worker that has ended is reported. Only when nothing
        # arrived for a slice, so a worker's last replies (its Stopped) are read before its end
        end = None if timeout is None else REAL.monotonic() + timeout
        while True:
            left = None if end is None else max(end - REAL.monotonic(), 0.0)
            try:
                return self._receive(LIVENESS_CHECK_S if left is None else min(left, LIVENESS_CHECK_S))
            except TimeoutError:
                lost = self.live.take_lost()
                if lost is not None:
                    raise WorkerLost(lost) from None
                if end is not None and REAL.monotonic() >= end:
                    raise

    def _receive(self, timeout: float | None) -> tuple[int, messages.Reply]:
        self._reap()
        # asleep in the doorbell only with no send in flight: a large command moves while
        # both ends drive MPI's progress, and the worker receiving it does not ring
        wire, src = recv_from(self.comm, tag=TAG_REPLY, timeout=timeout, bell=self.bell,
                                may_sleep=self._idle)
        return self._decoded(src, wire)

    def poll(self) -> tuple[int, messages.Reply] | None:
        m = poll(self.comm, tag=TAG_REPLY)
        return None if m is None else self._decoded(m[1], m[0])

    def _decoded(self, src: int, wire) -> tuple[int, messages.Reply]:
        msg = messages.decode(wire)
        if self.live is not None and isinstance(msg, messages.Stopped):
            self.live.expect(src)           # its process ends next: no loss
        return src, msg

    def abort(self, code: int) -> None:
        abort(self.comm, code)

    def close(self) -> None:
        """Wait (without a spin) until every command sent has been received."""
        self._reap()
        waitall([r for _, r in self.sending])
        self.sending = []

    def _reap(self) -> None:
        self.sending = [(rank, r) for rank, r in self.sending if not self._dead(rank) and not r.Test()]

    def _dead(self, rank: int) -> bool:
        return peer_ended(self.live, rank)

    def _idle(self) -> bool:
        self._reap()
        return not self.sending


def recv_command(comm: MPI.Comm, orch: int, bell: Doorbell | None = None) -> messages.Command:
    """A worker's next command from the orchestrator (waiting without a spin; asleep until
    the orchestrator rings, with a `bell`)."""
    return messages.decode(recv(comm, source=orch, tag=TAG_CMD, bell=bell))


def send_reply(comm: MPI.Comm, orch: int, msg: messages.Reply, bell: Doorbell | None = None) -> None:
    """Post the reply, ring the orchestrator, and return once it has the message (a large
    reply moves while both drive MPI's progress; this end polls meanwhile)."""
    req = comm.isend(messages.encode(msg), dest=orch, tag=TAG_REPLY)
    if bell is not None:
        bell.ring(orch)
    wait(req)


class Aborted(Exception):
    """FakeTransport.abort: the job would have ended with `code`."""

    def __init__(self, code: int) -> None:
        super().__init__(f"aborted with exit code {code}")
        self.code = code


class FakeTransport:
    """In memory, for unit tests: every command is recorded in `sent` and answered at once
    by `respond(rank, command)`, whose (source rank, reply) pairs are delivered in order.
    A script that leaves a command unanswered makes `receive` time out (after sleeping the
    timeout: keep run.worker_timeout small), as a hung worker would."""

    def __init__(self, respond: Callable[[int, messages.Command], Iterable[tuple[int, messages.Reply]]]) -> None:
        self.respond = respond
        self.sent: list[tuple[int, messages.Command]] = []
        self.queue: deque[tuple[int, messages.Reply]] = deque()

    def send(self, rank: int, msg: messages.Command) -> None:
        messages.decode(messages.encode(msg))                  # what MPI would carry must round-trip
        self.sent.append((rank, msg))
        self.queue.extend(self.respond(rank, msg))

    def receive(self, timeout: float | None = None) -> tuple[int, messages.Reply]:
        if self.queue:
            return self.queue.popleft()
        if timeout is None:
            raise RuntimeError("the orchestrator waits for a reply with no command outstanding")
        REAL.sleep(timeout)
        raise TimeoutError(f"no reply in {timeout} s")

    def poll(self) -> tuple[int, messages.Reply] | None:
        return self.queue.popleft() if self.queue else None

    def abort(self, code: int) -> None:
        raise Aborted(code)
