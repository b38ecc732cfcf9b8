"""The requeue code, and how a rank tells the batch script that the job should be requeued.

A fault the run survives (a dead or hung rank, a lost tool rank, a preemption signal) ends
the job with EXIT_REQUEUE. Under srun that code does not reach the batch script intact: a
rank's `MPI_Abort(75)` makes srun kill the other tasks, and srun then reports the highest
status, 137 for a SIGKILLed task, whatever the MPI (MPICH or Open MPI, pmi2 or pmix). So
before a rank leaves with EXIT_REQUEUE it writes one line, the cause, to the file named by
`FLEXMARL_REQUEUE_FILE` (one per incarnation, set by the batch script,
flexmarl_hpc/launch/sbatch.py); the script reads a status as 75 when that file exists.

A rank can also die with no word at all (SIGKILL, the OOM killer, a lost node), and under an
MPI whose runtime then kills every other rank at once (Open MPI under PMIx, measured: the
others are gone before the orchestrator can notice) no rank writes the requeue file. So the
inverse is said too: a rank that ends the job for a genuine error (a traceback, exit 1) first
writes `FLEXMARL_ERROR_FILE`, and the script reads a step killed by a signal (srun > 128)
with neither file as a lost rank, requeued (slurm.max_restarts bounds a rank that dies on
every start). Outside Slurm the variables are unset and `mark`/`mark_error` do nothing.
"""
from __future__ import annotations

import os

EXIT_REQUEUE = 75
"""EX_TEMPFAIL: checkpointed (or journaled) and ended for a requeue; the same command resumes."""
ENV = "FLEXMARL_REQUEUE_FILE"
ERROR_ENV = "FLEXMARL_ERROR_FILE"


def mark(cause: str) -> None:
    """Record that this rank ends the job for a requeue, and why (the first rank's line
    wins: O_EXCL). Never raises: a rank on its way out must still leave."""
    _write(ENV, cause)


def mark_error(cause: str) -> None:
    """Record that this rank ends the job for a genuine error (no requeue), and what."""
    _write(ERROR_ENV, cause)


def _write(env: str, cause: str) -> None:
    path = os.environ.get(env)
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return                                   # another rank was first, or the folder is gone
    try:
        os.write(fd, (" ".join(cause.split()) + "\n").encode())
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
