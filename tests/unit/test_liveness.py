"""The liveness star's end on socket pairs (runtime/liveness.py): a peer whose socket
closes is reported once, unless its end was expected or the run is stopping. Over real MPI
ranks and kills: tests/mpi/test_dead_rank.py."""
import socket
import time

from flexmarl_hpc.runtime.liveness import Liveness


def _lost_after_close(prepare) -> int | None:
    a, b = socket.socketpair()
    live = Liveness({1: a})
    prepare(live)
    live.watch()
    b.close()                                   # what the kernel does for a killed process
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2.0:
        lost = live.take_lost()
        if lost is not None:
            return lost
        time.sleep(0.01)
    return None


def test_a_closed_peer_is_reported_once_unless_expected_or_disarmed():
    a, b = socket.socketpair()                  # b stays open: the peer lives
    live_peers = Liveness({1: a})
    live_peers.watch()
    time.sleep(0.1)
    assert live_peers.take_lost() is None and b.fileno() >= 0   # an open, silent peer is alive
    assert _lost_after_close(lambda live: None) == 1
    assert _lost_after_close(lambda live: live.expect(1)) is None
    assert _lost_after_close(lambda live: live.disarm()) is None
