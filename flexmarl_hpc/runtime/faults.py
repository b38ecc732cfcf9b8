"""Test-only fault injection for `scripts/faults.py`: kill this process at a named point.

`FLEXMARL_FAULT="point:count:rank[:restart]"` makes world rank `rank` SIGKILL itself the
`count`-th time it reaches `hit(point)` (with `restart`: only in that incarnation of a Slurm
job, SLURM_RESTART_COUNT; points: `mpi_start`, before MPI_Init, where the rank SIGSTOPs itself
instead: a rank hung in MPI start-up; `checkpoint_write`, mid checkpoint file, before fsync
and rename; `checkpoint_latest`, file renamed, `latest` not yet updated; `store_append`,
a table's rows written, /commit not yet; `store_flush`, data flushed, /commit not yet; `store_torn`, a chunk rewritten
with its new bytes but its old checksum, as a kill inside the write leaves it, /commit not yet; `ppo_replay`, a trainer rank between a replay
pass of trainer.ppo_epochs and its optimizer step).
Unset (every real run), `hit` is a function that returns at once.
"""
from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("FLEXMARL_FAULT", "")
_seen: dict[str, int] = {}


def _hit(point: str, before=None) -> None:
    want, count, rank, *restart = _SPEC.split(":")
    if point != want or os.environ.get("PMI_RANK", "0") != rank:
        return
    if restart and os.environ.get("SLURM_RESTART_COUNT", "0") != restart[0]:
        return
    _seen[point] = _seen.get(point, 0) + 1
    if _seen[point] == int(count):
        if before is not None:                    # the state a kill mid-write leaves (store_torn)
            before()
        # no handler, no cleanup: a node failure; or a process that never goes on (mpi_start)
        os.kill(os.getpid(), signal.SIGSTOP if point == "mpi_start" else signal.SIGKILL)


def _off(point: str, before=None) -> None:
    pass


ARMED = bool(_SPEC)                               # callers skip building `before` when False
hit = _hit if _SPEC else _off
