"""The liveness star's end on socket pairs (runtime/liveness.py): a peer whose socket
closes is reported once, unless its end was expected or the run is stopping. Over real MPI
ranks and kills: tests/mpi/test_dead_rank.py."""
import socket
import threading
import time

from flexmarl_hpc.runtime.liveness import Liveness


def _lost_after_close(prepare) -> int | None:
    """What take_lost says once the watching thread has seen the close and ended (its
    one socket gone): known, not waited out (a fixed wait for a None cost 2 s each)."""
    a, b = socket.socketpair()
    live = Liveness({1: a})
    prepare(live)
    before = set(threading.enumerate())
    live.watch()
    (watcher,) = set(threading.enumerate()) - before
    b.close()                                   # what the kernel does for a killed process
    watcher.join(timeout=10)
    assert not watcher.is_alive(), "the watching thread did not see the close"
    return live.take_lost()


def test_a_closed_peer_is_reported_once_unless_expected_or_disarmed():
    a, b = socket.socketpair()                  # b stays open: the peer lives
    live_peers = Liveness({1: a})
    live_peers.watch()
    time.sleep(0.1)
    assert live_peers.take_lost() is None and b.fileno() >= 0   # an open, silent peer is alive
    assert _lost_after_close(lambda live: None) == 1
    assert _lost_after_close(lambda live: live.expect(1)) is None
    assert _lost_after_close(lambda live: live.disarm()) is None


def test_a_loss_nobody_takes_runs_on_untaken_and_a_taken_one_does_not(monkeypatch):
    """Rank 0's main thread stuck inside MPI (an isend to the dead rank retrying its
    connection forever) never takes the loss: the watching thread acts on it instead."""
    from flexmarl_hpc.runtime import liveness
    monkeypatch.setattr(liveness, "TAKE_GRACE_S", 0.2)

    def run(take: bool) -> list[int]:
        a, b = socket.socketpair()
        live, called = Liveness({1: a}), []
        live.on_untaken = called.append
        live.watch()
        b.close()
        t0 = time.monotonic()
        while not live.ended(1) and time.monotonic() - t0 < 2.0:
            time.sleep(0.01)
        assert live.ended(1)                    # seen, and not consumed by the look
        if take:
            assert live.take_lost() == 1 and live.ended(1)     # taken, and still dead for sends
        time.sleep(0.6)
        return called

    assert run(take=False) == [1]
    assert run(take=True) == []


def test_a_command_to_a_rank_known_dead_is_not_sent():
    """MpiTransport.send: an isend to a dead rank can hang in the MPI library; the command is
    dropped and the next receive reports the loss."""
    from flexmarl_hpc.runtime import messages
    from flexmarl_hpc.runtime.transport import MpiTransport

    class Comm:
        def __init__(self):
            self.sent = []

        def isend(self, wire, dest, tag):
            self.sent.append(dest)
            raise AssertionError("an isend reached a dead rank")

    a, b = socket.socketpair()
    live = Liveness({1: a})
    live.watch()
    b.close()
    t0 = time.monotonic()
    while not live.ended(1) and time.monotonic() - t0 < 2.0:
        time.sleep(0.01)
    comm = Comm()
    MpiTransport(comm, None, live).send(1, messages.Stop(0))
    assert comm.sent == []


def test_a_dead_tool_rank_gets_no_call_and_its_sends_are_not_tested():
    """RemotePool (rank 0's end of the tool ranks): the same rule, for calls and for the
    sends already posted to a rank that then ended."""
    import asyncio
    from flexmarl_hpc.config.schema import ToolsConfig
    from flexmarl_hpc.ranks.tool_ranks import RemotePool

    class Req:
        def Test(self):
            raise AssertionError("a send to a dead rank was tested")

    class Comm:
        def __init__(self):
            self.sent = []

        def isend(self, wire, dest, tag):
            self.sent.append(dest)
            return Req()

        def Iprobe(self, source=None, tag=None, status=None):
            return False                        # no answer arrives

    a, b = socket.socketpair()
    live = Liveness({3: a})
    live.watch()
    comm = Comm()
    pool = RemotePool(comm, [3], ToolsConfig(), live=live)
    pool.sending.append((3, Req()))              # posted before the rank ended
    b.close()
    t0 = time.monotonic()
    while not live.ended(3) and time.monotonic() - t0 < 2.0:
        time.sleep(0.01)
    done, rank = asyncio.run(pool._ask(lambda i: None, 1.0))
    assert (done, rank, comm.sent) == (None, 3, [])
    asyncio.run(pool._receive())                 # nothing pending: returns at once
    pool.pending[0] = None                       # one pending call: a pass over the sends
    pool.sending = [(3, Req())]

    async def one_pass():
        task = asyncio.ensure_future(pool._receive())
        await asyncio.sleep(0.05)
        task.cancel()
    asyncio.run(one_pass())
    assert pool.sending == []
