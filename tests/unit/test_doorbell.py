"""Doorbell wake-ups (flexmarl_hpc/runtime/doorbell.py) and the wait loop that sleeps in them
(comm.until): unit tests on socket pairs, no MPI job. The MPI test
(tests/mpi/test_doorbell_mpi.py) runs the orchestrator's star under mpiexec."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from flexmarl_hpc.runtime import comm
from flexmarl_hpc.runtime.doorbell import Doorbell


def pair() -> tuple[Doorbell, Doorbell]:
    a, b = socket.socketpair()
    return Doorbell({1: a}), Doorbell({0: b})


def test_a_ring_wakes_the_peer_and_is_consumed():
    orch, worker = pair()
    assert worker.sleep(0) is False                    # nothing rung yet
    orch.ring(1)
    orch.ring(1)
    assert worker.sleep(5.0) is True                   # returns on the rings, not the timeout
    assert worker.sleep(0) is False                    # both consumed at once
    worker.ring(0)
    assert orch.sleep(5.0) is True


def test_ringing_a_peer_that_never_reads_never_blocks_the_sender():
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    orch = Doorbell({1: a})
    for _ in range(100_000):                           # far more than the buffers hold
        orch.ring(1)
    assert Doorbell({0: b}).sleep(0) is True


def test_a_peer_that_ended_is_dropped_not_reported_forever():
    orch, worker = pair()
    worker.close()
    assert orch.sleep(1.0) is True                     # the close wakes it once ...
    assert orch.peers == {}                            # ... and the socket is gone
    assert orch.sleep(0) is False                      # no busy loop on a dead peer
    orch.ring(1)                                       # ringing it is a no-op, not an error


def test_until_sleeps_in_the_bell_until_a_ring_and_then_sees_the_message():
    orch, worker = pair()
    arrived = threading.Event()

    def sender():
        time.sleep(0.2)
        arrived.set()                                  # the "MPI message", posted first
        orch.ring(1)

    threading.Thread(target=sender).start()
    looks = []

    def ready():
        looks.append(1)
        return arrived.is_set()

    comm.until(ready, timeout=10.0, bell=worker)
    # asleep between looks: a polling wait would have looked ~400 times in 0.2 s
    assert len(looks) < 20, len(looks)


def test_until_polls_while_may_sleep_says_no_and_times_out_naming_what():
    _, worker = pair()
    looks = []
    with pytest.raises(TimeoutError, match="no reply from rank 3 in 0.05 s"):
        comm.until(lambda: looks.append(1) is not None, timeout=0.05, bell=worker,
                may_sleep=lambda: False, what="no reply from rank 3")
    assert len(looks) > 20                             # polled with back-off, never slept
