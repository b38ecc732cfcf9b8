"""A requeued Slurm step gets through MPI_Init after its earlier incarnation was SIGKILLed.

MPICH names each node's shared-memory slab after the PMI kvs name, which under srun is
"JOB.STEP" and so the same for every incarnation of a requeued job: the killed incarnation's
slab was left in /dev/shm, and the next one hung in MPI_Init (docs/LOG.md, 2026-11-29; the
cause of the start-up watchdog test's restart loop in CI). The ranks clear it first
(flexmarl_hpc/runtime/stale_shm.py, called before MPI_Init); this job does what a rank does,
as a het job of two components with two ranks each (the local cluster's nodes share one
/dev/shm), in two incarnations, with the batch script's own incarnation line
(launch/sbatch.py, incarnation_lines). Two earlier failures are held here:
- the job's id is first given the marker an earlier cluster lifetime's job of the same id
  would have left (the local cluster starts with fresh state, so ids come round again: both
  ranks saw the slab and removed nothing);
- every rank of both components must see one incarnation, and exactly one rank clears: srun
  listens on one port per het component, and with its address as the incarnation each
  component cleared, removing the slab the other had made (hetero_cpu hung in MPI_Init).

    pytest tests/slurm/test_stale_shm_slurm.py
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from flexmarl_hpc.launch.sbatch import incarnation_lines
from flexmarl_hpc.runtime.stale_shm import SHM, clear_stale_segments
from tests.conftest import ROOT
from tests.helpers import wait_for

FIRST = """
import os, signal
from mpi4py import MPI
for _ in range(3):
    MPI.COMM_WORLD.allreduce(1)                    # the node's slab in use, as in a run
print("first incarnation: rank", MPI.COMM_WORLD.rank, "killed", flush=True)
os.kill(os.getpid(), signal.SIGKILL)               # a node failure: no MPI_Finalize
"""
SECOND = """
import os
from flexmarl_hpc.runtime.stale_shm import clear_stale_segments, incarnation, segment_prefixes
left = [n for n in os.listdir("/dev/shm") if n.startswith(segment_prefixes(os.environ["PMI_JOBID"]))]
print("stale before MPI_Init:", sorted(left), "removed:", sorted(clear_stale_segments()),
      "incarnation:", incarnation(os.environ), flush=True)
from mpi4py import MPI
print("second incarnation: rank", MPI.COMM_WORLD.rank, "sum", MPI.COMM_WORLD.allreduce(1), flush=True)
"""


def _show(job: str) -> str:
    return subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30).stdout


@pytest.mark.slurm
def test_a_requeued_step_starts_after_its_killed_incarnation_left_its_slab(slurm, tmp_path):
    out = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    (tmp_path / "first.py").write_text(FIRST)
    (tmp_path / "second.py").write_text(SECOND)
    script.write_text("\n".join([
        "#!/bin/bash",
        f"#SBATCH --nodes=1 --ntasks=2 --output={out} --open-mode=append --requeue --time=5",
        "#SBATCH hetjob",
        "#SBATCH --nodes=1 --ntasks=2",
        f"export PYTHONPATH={ROOT}",
        *incarnation_lines(),
        'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then',
        f"  srun --mpi=pmi2 --het-group=0,1 {sys.executable} {tmp_path / 'first.py'}",
        '  scontrol requeue "$SLURM_JOB_ID" || echo "requeue refused"',
        "else",
        f"  timeout 60 srun --mpi=pmi2 --het-group=0,1 {sys.executable} {tmp_path / 'second.py'}",
        '  echo "second srun exit $?"',
        "fi", ""]))
    job = subprocess.run(["sbatch", "--parsable", "--hold", str(script)], capture_output=True,
                         text=True, timeout=30, check=True).stdout.strip()
    try:
        # job JOB of an earlier cluster lifetime, in its second incarnation (srun on port 1, which
        # no srun of this one has: it is privileged)
        clear_stale_segments({"PMI_JOBID": f"{job}.0", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "1",
                              "SLURM_SRUN_COMM_HOST": "127.0.0.1", "SLURM_SRUN_COMM_PORT": "1"})
        subprocess.run(["scontrol", "release", job], check=True, capture_output=True, timeout=30)
        wait_for(lambda: out.exists() and "killed" in out.read_text(), 120, "the first incarnation")
        # released as `submit --wait` releases a requeue hold (SlurmRun.release_requeue_hold:
        # StartTime=now once seen held 2 s; right after the requeue the job would start on a
        # credential slurmd has just revoked): without it the requeued het job waited 80-90 s
        # here for an event to wake the backfill scheduler (het jobs start only from it)
        wait_for(lambda: "Reason=BeginTime" in _show(job), 60, "the requeue hold")
        time.sleep(2)
        subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], capture_output=True, timeout=30)
        wait_for(lambda: "second srun exit" in out.read_text(), 240, "the second incarnation", poll=1)
        text = out.read_text()
        assert "second srun exit 0" in text, text           # 124: hung in MPI_Init for 60 s
        assert text.count("second incarnation: rank") == 4 and text.count("sum 4") == 4, text
        stale = [line for line in text.splitlines() if line.startswith("stale before MPI_Init")]
        assert len(stale) == 4 and any("mpich_shm_" in line for line in stale), text  # the killed slab was there
        assert len({line.split("incarnation: ")[1] for line in stale}) == 1, text    # one name, both components
        assert sum("removed: []" not in line for line in stale) == 1, text          # one rank cleared
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
        (SHM / f"flexmarl-{job}.0.lock").unlink(missing_ok=True)
