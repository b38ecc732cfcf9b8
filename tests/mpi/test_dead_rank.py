"""A rank killed with SIGKILL ends the job in seconds even when the launcher leaves the
others running, as Slurm's het step does without --kill-on-bad-exit (docs/slurm.md). The
liveness star (flexmarl_hpc/runtime/liveness.py) must do it: without it the workers wait
for a command forever, and the orchestrator for a reply until run.worker_timeout.

mpiexec alone would hide that: it ends every rank once one dies (or, with
-disable-auto-cleanup, signals them USR1). So each rank runs under a shell that outlives it
(`python ...; echo exit code; sleep`): mpiexec sees no death, the ranks are on their own,
and the shell reports each rank's exit code. The Slurm form: tests/slurm/test_dead_rank_slurm.py."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid

import pytest

from flexmarl_hpc.config.load import load_plan
from tests.conftest import ROOT
from tests.helpers import SMALL_ANY_STEPS, wait_for

sys.path.insert(0, str(ROOT / "scripts"))
import faults  # noqa: E402  (scripts/faults.py: rank_pids finds ranks by their launcher rank and a tag)

RANK_CMD = "flexmarl_hpc.run"
"""In a rank's command line, not its shell's."""
BOUND_S = 10.0
"""Kill -> every other rank gone. Measured ~1-2 s; run.worker_timeout is 1800 s."""


def start(mpiexec: str, tmp, tag: str, *overrides: str) -> subprocess.Popen:
    ov = [*SMALL_ANY_STEPS, "run.steps=5000", f"run.output_dir={tmp}", *overrides]
    n = load_plan(str(ROOT / "configs/local.yaml"), ov).layout.world_size
    rank = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "flexmarl_hpc.run", "configs/local.yaml", *ov])
    cmd = [mpiexec, "-n", str(n), "bash", "-c", f'{rank}; echo "rank $PMI_RANK exited $?" >&2; sleep 60']
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLEXMARL_FAULT_TAG": tag}
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    wait_for(lambda: "step    3/" in (tmp / "train.log").read_text() if (tmp / "train.log").exists() else False,
             180, "step 3")
    return p


def kill_and_time(p: subprocess.Popen, tag: str, rank: int) -> tuple[float, str, str, dict[str, str]]:
    """SIGKILL `rank`; (seconds until every rank is gone, mpiexec's stdout and stderr, each
    rank's exit code as its shell reported it). mpiexec, its shells and any rank left are
    then killed: a test that fails must not hang."""
    pids = faults.rank_pids(tag, RANK_CMD)
    assert rank in pids and len(pids) >= 4, pids
    os.kill(pids[rank], signal.SIGKILL)
    t0 = time.monotonic()
    while faults.rank_pids(tag, RANK_CMD) and time.monotonic() - t0 < BOUND_S + 5:
        time.sleep(0.05)
    secs = time.monotonic() - t0
    left = faults.rank_pids(tag, RANK_CMD)
    time.sleep(1.0)                                  # the shells' last lines reach mpiexec
    os.killpg(p.pid, signal.SIGKILL)                 # mpiexec and the shells (sleeping)
    for pid in left.values():
        os.kill(pid, signal.SIGKILL)
    out, err = p.communicate(timeout=60)
    codes = dict(re.findall(r"rank (\d+) exited (\d+)", err))
    print(f"SIGKILL rank {rank} -> all ranks gone in {secs:.2f} s; exit codes {codes}; left: {left}")
    return secs, out, err, codes


@pytest.mark.parametrize("idle_wait", ["doorbell", "poll"])
def test_workers_exit_in_seconds_when_the_orchestrator_is_killed(mpiexec, tmp_path, idle_wait):
    tag = uuid.uuid4().hex
    p = start(mpiexec, tmp_path, tag, f"run.idle_wait={idle_wait}")
    secs, out, err, codes = kill_and_time(p, tag, 0)
    assert secs < BOUND_S, f"workers outlived the orchestrator by {secs:.1f} s\n{err[-3000:]}"
    lines = [ln for ln in err.splitlines() if "the orchestrator (rank 0) has ended" in ln]
    assert len(lines) == 3 and all("exiting 75" in ln for ln in lines), err[-3000:]
    assert codes == {"0": "137", "1": "75", "2": "75", "3": "75"}, err[-3000:]


def test_the_orchestrator_requeues_in_seconds_when_a_replica_is_killed(mpiexec, tmp_path):
    tag = uuid.uuid4().hex
    p = start(mpiexec, tmp_path, tag)
    secs, out, err, codes = kill_and_time(p, tag, 1)
    log = (tmp_path / "train.log").read_text()
    assert secs < BOUND_S, f"the job outlived the replica by {secs:.1f} s\n{log[-2000:]}"
    assert "replica 0 (rank 1): its process has ended (liveness socket closed)" in log, (log[-2000:], err[-3000:])
    assert "flushing the store, exiting 75 to requeue" in log, log[-2000:]
