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
leaves a marker for the incarnation; later local ranks see the marker and leave the
segments alone, since by then a rank may be creating the new ones. Nothing happens outside
Slurm (mpiexec's kvs names are unique per launch) or without PMI_JOBID (PMIx, Open MPI).
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


def clear_stale_segments(env: Mapping[str, str] = os.environ, shm: Path = SHM) -> list[str]:
    """The names removed (none for the ranks after the first of this incarnation here)."""
    kvs = env.get("PMI_JOBID", "")
    if not kvs or "SLURM_STEP_ID" not in env or not shm.is_dir() or "/" in kvs:
        return []
    incarnation = env.get("SLURM_RESTART_COUNT", "0")
    try:
        with open(shm / f"flexmarl-{kvs}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            marker = shm / f"flexmarl-{kvs}-{incarnation}.cleared"
            if marker.exists():
                return []
            prefixes = segment_prefixes(kvs)
            removed = [p.name for p in shm.iterdir() if p.name.startswith(prefixes)]
            for name in removed:
                (shm / name).unlink(missing_ok=True)
            for old in shm.glob(f"flexmarl-{kvs}-*.cleared"):
                old.unlink(missing_ok=True)
            marker.touch()
            return removed
    except OSError:
        return []                                # a read-only or odd /dev/shm: MPI_Init as before
