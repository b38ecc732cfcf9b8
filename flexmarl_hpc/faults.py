"""Test-only fault injection for `scripts/faults.py`: kill this process at a named point.

`FLEXMARL_FAULT="point:count:rank[:stall][:restart=N]"` makes world rank `rank` SIGKILL itself
the `count`-th time it reaches `hit(point)`; with `stall` it stalls there instead (asleep for
good, its process and sockets alive: a hung rank, not a dead one); with `restart=N` only in
that incarnation of a Slurm job (SLURM_RESTART_COUNT). Points: `mpi_start`, before MPI_Init
(stalled: a rank hung in MPI start-up); `checkpoint_write`, mid checkpoint file, before fsync
and rename; `checkpoint_latest`, file renamed, `latest` not yet updated; `store_append`, a
table's rows written, /commit not yet; `store_flush`, data flushed, /commit not yet;
`store_torn`, a chunk rewritten with its new bytes but its old checksum, as a kill inside the
write leaves it, /commit not yet; `ppo_replay`, a trainer rank between a replay pass of
trainer.ppo_epochs and its optimizer step; `sync_join`, a replica given a weight sync, before
it joins; `build`, a worker rank with its engine or trainer built, before start-up's barrier.
Unset (every real run), `hit` is a function that returns at once.
"""
from __future__ import annotations

import os
import signal

from flexmarl_hpc.clock import REAL

_SPEC = os.environ.get("FLEXMARL_FAULT", "")
_seen: dict[str, int] = {}
RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")
"""Where a launcher puts a process's world rank before MPI_Init: MPICH's PMI (mpiexec, srun
--mpi=pmi2), PMIx (srun --mpi=pmix, Open MPI), Open MPI's mpirun."""


def launcher_rank(env=os.environ) -> int | None:
    """This process's world rank as its launcher set it, before (or without) MPI_Init."""
    return next((int(env[v]) for v in RANK_VARS if v in env), None)


def _hit(point: str, before=None) -> None:
    want, count, rank, *how = _SPEC.split(":")
    if point != want or (launcher_rank() or 0) != int(rank):
        return
    restart = [h.split("=", 1)[1] for h in how if h.startswith("restart=")]
    if restart and os.environ.get("SLURM_RESTART_COUNT", "0") != restart[0]:
        return
    _seen[point] = _seen.get(point, 0) + 1
    if _seen[point] == int(count):
        if before is not None:                    # the state a kill mid-write leaves (store_torn)
            before()
        while "stall" in how:                     # hung: no CPU, never back
            REAL.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)      # no handler, no cleanup: a node failure


def _off(point: str, before=None) -> None:
    pass


ARMED = bool(_SPEC)                               # callers skip building `before` when False
hit = _hit if _SPEC else _off
