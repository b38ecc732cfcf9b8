"""Remove the shared-memory segments a killed incarnation of this Slurm step left behind,
before MPI_Init, so that a requeued job does not hang in it.

MPICH (4.x, the pip `mpich` wheel) names each node's shared-memory slab after its PMI world:
`/dev/shm/mpich_shm_<FNV-1a of the PMI kvs name, hex>_<node>` (and `mpich_vci_...`). The
first local rank creates it with O_EXCL and becomes its root, which unlinks it in
MPI_Finalize; the others open the existing file and trust its contents. Under Slurm's pmi2
plugin the kvs name is `PMI_JOBID`, "JOB.STEP", and a requeued job runs step 0 again: its
ranks find the segments of the incarnation that was SIGKILLed (MPI_Abort, a dead rank, the
start-up watchdog), none of them becomes root, they read the old queue and barrier state, and
every rank of the node waits in MPI_Init for good. The start-up watchdog then requeues the
job, which finds the same files: docs/LOG.md, 2026-11-29, and docs/slurm.md, 'MPI start-up'.

So every rank calls `clear_stale_segments` before MPI_Init. The first rank of this
incarnation to take the lock on a node's /dev/shm removes the segments of this kvs name and
writes the incarnation into the lock file; later local ranks find it there and leave the
segments alone, since by then a rank may be creating the new ones. Nothing happens outside
Slurm (mpiexec's kvs names are unique per launch) or without PMI_JOBID (PMIx, Open MPI).

The incarnation must be the same on every node and het component of the step and new at each
start. The batch script makes it (`FLEXMARL_INCARNATION`, launch/sbatch.py: job, restart count,
and the batch shell's start in ns) and srun hands it to every task. The restart count alone is
not unique: a job id comes round again (a slurmctld whose state was reset, as the local test
cluster's is at each start, or MaxJobId's wrap), and the marker an earlier cluster lifetime's
job of that id left made a requeued step skip the clean-up and hang in MPI_Init (CI,
2026-11-29). Nor is the srun's (host, port) the same on every node: srun listens on one port
per het component, so the first rank of each component took the step for a new incarnation
and removed the slabs the other components' ranks had just made, and the six-component job
hung in MPI_Init (CI, 2026-11-29, the second failure). A step started without our batch
script falls back to the restart count with the srun's address, which holds for a step of
one component.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Mapping

SHM = Path("/dev/shm")


def fnv1a32(text: str) -> int:
    """32-bit FNV-1a, as MPICH hashes the kvs name into its world id (uthash's HASH_FNV)."""
    h = 2166136261
    for byte in text.encode():
        h = ((h ^ byte) * 16777619) & 0xFFFFFFFF
    return h


def segment_prefixes(kvs: str) -> tuple[str, ...]:
    world = f"{fnv1a32(kvs):x}"
    return f"mpich_shm_{world}_", f"mpich_vci_{world}_"


INCARNATION_ENV = "FLEXMARL_INCARNATION"


def incarnation(env: Mapping[str, str]) -> str:
    """This incarnation of the step, the same on each of its nodes (module docstring)."""
    if env.get(INCARNATION_ENV):
        return env[INCARNATION_ENV]
    return ":".join(env.get(key, "") for key in
                    ("SLURM_RESTART_COUNT", "SLURM_SRUN_COMM_HOST", "SLURM_SRUN_COMM_PORT"))


def clear_stale_segments(env: Mapping[str, str] = os.environ, shm: Path = SHM) -> list[str]:
    """The names removed (none for the ranks after the first of this incarnation here)."""
    kvs = env.get("PMI_JOBID", "")
    if not kvs or "SLURM_STEP_ID" not in env or not shm.is_dir() or "/" in kvs:
        return []
    this = incarnation(env)
    try:
        with open(shm / f"flexmarl-{kvs}.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            lock.seek(0)
            if lock.read() == this:
                return []
            prefixes = segment_prefixes(kvs)
            removed = [p.name for p in shm.iterdir() if p.name.startswith(prefixes)]
            for name in removed:
                (shm / name).unlink(missing_ok=True)
            for old in shm.glob(f"flexmarl-{kvs}-*.cleared"):   # the markers of 2026-11-29's first version
                old.unlink(missing_ok=True)
            lock.truncate(0)
            lock.write(this)
            lock.flush()
            return removed
    except OSError:
        return []                                # a read-only or odd /dev/shm: MPI_Init as before
