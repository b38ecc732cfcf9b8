"""MPI helpers that never busy-poll.

MPICH's blocking receive spins a core at 100 % while it waits. Our ranks outnumber the
cores (an orchestrator, replicas and trainers on a 2-core node), so a spinning waiter
steals the CPU from the rank doing the work. Every wait here polls with `Iprobe`/`Test`
and sleeps with exponential back-off (20 us .. 0.5 ms): at most ~0.5 ms of added latency
and a few thousand cheap wake-ups a second per waiting rank. Cheap for the waiter, not for
the rank each wake-up preempts on a full node: where the sender rings a doorbell
(flexmarl_hpc.runtime.doorbell: the orchestrator and its workers), the wait sleeps until it does.
Communicators are always passed in.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

from mpi4py import MPI

from flexmarl_hpc.clock import REAL
from flexmarl_hpc.runtime import requeue
from flexmarl_hpc.runtime.backoff import Backoff, until  # noqa: F401 (comm.until, comm.Backoff)
from flexmarl_hpc.runtime.doorbell import Doorbell

# message tags (one namespace for the whole job)
TAG_CMD = 1          # orchestrator -> worker commands
TAG_REPLY = 2        # worker -> orchestrator results
TAG_GROUP = 3        # trainer leader -> group members
TAG_STATE = 4        # state swap payloads between ranks
TAG_JOIN = 5         # weight-sync members announcing themselves to the root (deadline.join)
TAG_TOOL = 6         # tool rank -> orchestrator: results of tool calls (ranks/tool_ranks.py)


# mpiexec (hydra) forwards a rank's output through its proxy; MPI_Abort can end mpiexec
# before output still in flight is written, so the line saying why the job ended was lost
# (seen once in CI). A second is nothing next to the timeout that led here.
ABORT_GRACE_S = 1.0


def abort(comm: MPI.Comm, code: int) -> None:
    """End the whole job with `code`, after the reason printed just before has left. With
    the requeue code the batch script is told first (runtime/requeue.py: srun would report
    the other tasks' SIGKILL instead), with any other that it is an error, not a lost rank; a
    caller that knows the cause marks it before."""
    if code == requeue.EXIT_REQUEUE:
        requeue.mark("a rank ended the job with the requeue code")
    else:
        requeue.mark_error(f"a rank ended the job with exit {code}")
    sys.stdout.flush()
    sys.stderr.flush()
    REAL.sleep(ABORT_GRACE_S)
    comm.Abort(code)


def recv(comm: MPI.Comm, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG,
         status: MPI.Status | None = None, timeout: float | None = None,
         bell: Doorbell | None = None, may_sleep: Callable[[], bool] | None = None) -> Any:
    """`comm.recv` without spinning. Raises TimeoutError after `timeout` seconds. With a
    `bell` (flexmarl_hpc.runtime.doorbell) the wait sleeps until the sender rings, whenever
    `may_sleep()` allows (the orchestrator's sends in flight need its MPI progress)."""
    st = status if status is not None else MPI.Status()
    until(lambda: comm.Iprobe(source=source, tag=tag, status=st), timeout, bell, may_sleep,
          f"no message from rank {source} (tag {tag})")
    return comm.recv(source=st.Get_source(), tag=st.Get_tag(), status=st)


def recv_from(comm: MPI.Comm, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG,
              timeout: float | None = None, bell: Doorbell | None = None,
              may_sleep: Callable[[], bool] | None = None) -> tuple[Any, int]:
    """Like `recv`, also returning the sender's rank."""
    st = MPI.Status()
    obj = recv(comm, source, tag, st, timeout, bell, may_sleep)
    return obj, st.Get_source()


def poll(comm: MPI.Comm, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> tuple[Any, int] | None:
    """A pending message (obj, source) or None, without waiting."""
    st = MPI.Status()
    if not comm.Iprobe(source=source, tag=tag, status=st):
        return None
    return comm.recv(source=st.Get_source(), tag=st.Get_tag()), st.Get_source()


def wait(req: MPI.Request) -> None:
    """`req.Wait()` for a non-blocking send or collective, without spinning."""
    until(req.Test)


def waitall(reqs: list[MPI.Request]) -> None:
    until(lambda: MPI.Request.Testall(reqs))


def bcast_buffer(comm: MPI.Comm, buf, root: int) -> None:
    wait(comm.Ibcast(buf, root=root))


def allreduce_sum(comm: MPI.Comm, buf) -> None:
    """In-place SUM allreduce of a numpy/torch-backed buffer."""
    if comm.Get_size() > 1:
        wait(comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM))


def barrier(comm: MPI.Comm) -> None:
    wait(comm.Ibarrier())


def bcast_obj(comm: MPI.Comm, obj: Any, root: int) -> Any:
    """Pickle-free-on-the-wire is not needed here: small control objects, broadcast without spinning."""
    import pickle
    import numpy as np
    if comm.Get_rank() == root:
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        n = np.array([data.size], dtype=np.int64)
    else:
        n = np.zeros(1, dtype=np.int64)
    bcast_buffer(comm, n, root)
    if comm.Get_rank() != root:
        data = np.empty(int(n[0]), dtype=np.uint8)
    bcast_buffer(comm, data, root)
    return obj if comm.Get_rank() == root else pickle.loads(data.tobytes())


def array_meta(arrays: dict) -> dict:
    """{name: (dtype, shape) or None} of a dict of numpy arrays: what `bcast_arrays`'
    receivers allocate (small; it travels in the sender's pickled control header)."""
    import numpy as np
    meta = {}
    for k, a in arrays.items():
        if a is not None and np.asarray(a).dtype.hasobject:
            raise TypeError(f"bcast_arrays: array {k!r} holds Python objects (no raw buffer)")
        meta[k] = None if a is None else (np.asarray(a).dtype.str, tuple(np.shape(a)))
    return meta


def bcast_arrays(comm: MPI.Comm, arrays: dict | None, meta: dict, root: int) -> dict:
    """numpy arrays from `root` to every rank as one raw byte buffer (no pickle: a
    micro-batch is array-sized, and bcast_obj would pickle it on the root and unpickle a
    copy on every rank); `meta`: array_meta(arrays), already known on every rank. The
    receivers' arrays are aligned views into their one received buffer."""
    import numpy as np
    spans = _spans(meta)
    total = max((o + n for o, n in spans.values()), default=0)
    mine = comm.Get_rank() == root
    buf = np.zeros(total, dtype=np.uint8) if mine else np.empty(total, dtype=np.uint8)
    if mine:
        for k, (o, n) in spans.items():
            buf[o:o + n] = np.ascontiguousarray(arrays[k]).reshape(-1).view(np.uint8)
    if total:
        bcast_buffer(comm, buf, root)
    if mine:
        return dict(arrays)
    out: dict = dict.fromkeys(meta)
    for k, (o, n) in spans.items():
        out[k] = buf[o:o + n].view(np.dtype(meta[k][0])).reshape(meta[k][1])
    return out


def _spans(meta: dict) -> dict[str, tuple[int, int]]:
    """(offset, bytes) of each array in bcast_arrays' buffer, each offset 64-byte aligned
    (the views are then aligned for any dtype, as torch.as_tensor wants them)."""
    import numpy as np
    spans, off = {}, 0
    for k, m in meta.items():
        if m is None:
            continue
        n = np.dtype(m[0]).itemsize * int(np.prod(m[1], dtype=np.int64))
        spans[k] = (off, n)
        off += -(-n // 64) * 64
    return spans


def bcast_tensors(comm: MPI.Comm, tensors: dict | None, root: int) -> dict | None:
    """A dict of host tensors (a training state: model-sized) from `root` to every rank, one
    tensor at a time into its own buffer: never pickled whole (`bcast_obj` would hold the
    state three times over on every rank), and not copied at all in a group of one."""
    if comm.Get_size() == 1:
        return tensors
    import torch
    mine = comm.Get_rank() == root
    meta = bcast_obj(comm, None if tensors is None else
                     [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], root)
    if meta is None:
        return None
    out = {}
    for name, dtype, shape in meta:
        t = tensors[name].contiguous() if mine else torch.empty(shape, dtype=dtype)
        if t.numel():
            bcast_buffer(comm, t.reshape(-1).view(torch.uint8).numpy(), root)
        out[name] = t
    return out
