"""runtime/deadline.py in one process: the waits of a weight sync end in CollectiveTimeout
at their deadline, return when the collective completes, and pass a failed collective's own
error on. The real thing, a member that never joins on real MPI ranks: tests/mpi/test_sync_deadline.py."""
from __future__ import annotations

import time

import pytest
from mpi4py import MPI

from flexmarl_hpc.runtime import deadline as D


class Work:
    """A torch.distributed Work stand-in: completes after `after` looks (never: None)."""

    def __init__(self, after: int | None, error: Exception | None = None):
        self.after, self.looks, self.error, self.waited = after, 0, error, False

    def is_completed(self) -> bool:
        self.looks += 1
        return self.after is not None and self.looks > self.after

    def wait(self):
        self.waited = True
        if self.error is not None:
            raise self.error
        return True


def test_a_collective_that_never_completes_ends_at_the_deadline():
    dl = D.Deadline(0.3, "weight sync over ranks [0, 5]")
    w = Work(None)
    t0 = time.monotonic()
    with pytest.raises(D.CollectiveTimeout) as e:
        D.wait_works([Work(0), w], dl, "the transfer")
    assert time.monotonic() - t0 >= 0.3
    assert (e.value.phase, e.value.timeout_s) == ("the transfer", 0.3)
    assert str(e.value).startswith("weight sync over ranks [0, 5]: the transfer not done ")
    assert str(e.value).endswith("(weight_sync.timeout_s=0.3)") and not w.waited
    assert isinstance(e.value, TimeoutError)
    assert 5 < w.looks < 2000                                  # back-off sleeps, not a spin


def test_completed_works_return_and_pass_their_error_on():
    works = [Work(3), Work(1)]
    D.wait_works(works, D.Deadline(10), "the transfer")
    assert all(w.waited for w in works)
    with pytest.raises(RuntimeError, match="gloo: connection reset"):
        D.wait_works([Work(0, RuntimeError("gloo: connection reset"))], D.Deadline(10), "the transfer")


def test_no_deadline_waits_as_long_as_it_takes():
    dl = D.Deadline(0)
    assert dl.left() is None
    w = Work(50)
    D.wait_works([w], dl, "the transfer")
    assert w.waited


def test_mpi_waits_by_the_deadline_on_one_rank():
    me = MPI.COMM_SELF
    import numpy as np
    buf = np.arange(3, dtype=np.int64)
    D.allreduce_sum(me, buf, D.Deadline(5), "the rendezvous")
    D.bcast(me, buf, 0, D.Deadline(5), "the layout")
    assert buf.tolist() == [0, 1, 2]
    D.join(me, (0,), D.Deadline(5), "joining")               # alone: nobody to wait for
    req = me.Irecv(np.zeros(1, np.int8), source=0, tag=77)    # a message that never comes
    with pytest.raises(D.CollectiveTimeout, match="the rendezvous not done"):
        D.wait_request(req, D.Deadline(0.2, "x"), "the rendezvous")
    req.Cancel()
    req.Wait()
