"""The tool pool's processes die with the rank that started them, even when it is SIGKILLed
and runs no cleanup of its own (docs/tools.md, "No process outlives its rank").

multiprocessing's forkserver keeps a pipe that every reward worker also holds, and each
worker blocks on a queue whose write end it holds itself: once their rank is gone neither
ever sees EOF, and they (and the resource tracker, which waits for EOF from all of them)
live on under PID 1. So each gets the kernel's parent-death signal (PR_SET_PDEATHSIG):

    rank --(its pdeathsig)--> forkserver --(its pdeathsig)--> reward workers

The forkserver sets its own by importing `flexmarl_hpc.tools.forkserver_preload` (the one
hook multiprocessing gives into that process); each worker in its initializer. The resource
tracker then reads EOF and exits by itself, after unlinking what they left. The signal
follows the *thread* that forked: the pool forks from its event loop's thread, which lives
as long as the rank (the main thread on tool ranks and on rank 0).
"""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal

PR_SET_PDEATHSIG = 1
OWNER = "FLEXMARL_POOL_OWNER"
"""Environment variable: the pid of the rank that starts the forkserver (its expected parent)."""
PRELOAD = "flexmarl_hpc.tools.forkserver_preload"

server_pid = 0
"""In a forkserver and the workers it forks: the forkserver's pid (set by PRELOAD)."""


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent ends; exit at once when `parent` is already not
    its parent (it died before the prctl, so no signal would ever come)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def worker_init() -> None:
    """A reward worker's initializer: forked by the forkserver, it dies with it (with its
    parent at least, when a server started elsewhere in the process did not preload us)."""
    die_with_parent(server_pid or os.getppid())


def forkserver_context():
    """The forkserver context, its server (started on first use, from the calling thread)
    tied to this process."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", PRELOAD])     # '__main__': multiprocessing's default
    os.environ[OWNER] = str(os.getpid())                    # inherited by the server it spawns
    return ctx
