"""Functions `ctx.call` / RemotePool.call run on a tool rank (module-level: they travel
pickled by name; tests/mpi/mpi_tools.py and tests/e2e/episodes.py)."""
from __future__ import annotations

import os
import time


def add(a, b):
    return a + b


def where():
    """The MPI rank whose worker process ran the call (inherited from the tool rank: mpiexec
    sets PMI_RANK, srun SLURM_PROCID); -1 if neither is set."""
    return int(os.environ.get("PMI_RANK", os.environ.get("SLURM_PROCID", "-1")))


def boom():
    raise ValueError("boom")


def die():
    os._exit(3)                     # the worker process ends mid-call: a crash


def sleepy(seconds):
    time.sleep(seconds)
    return "woke"
