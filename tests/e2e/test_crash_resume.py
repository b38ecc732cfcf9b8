"""End to end: every rank SIGKILLed mid-run (no checkpoint, the default), and the same
command resumes: the store is re-opened (flags cleared, torn rows discarded), reconciled
with version 0, rolled-back step rows marked superseded, every sample trained exactly once."""
import os
import subprocess
import sys
import time

import h5py

from flexmarl_hpc.analysis.load import load_run, summary
from tests.conftest import ROOT, run_training
from tests.helpers import SMALL, check_exactly_once, sigkill_tree

STEPS = 12


def test_sigkill_without_a_checkpoint_resumes_with_nothing_lost(tmp_path, mpiexec):
    args = [sys.executable, "-m", "flexmarl_hpc.run", "configs/local.yaml", f"run.output_dir={tmp_path}",
            *SMALL, f"run.steps={STEPS}", "run.checkpoint_every=0"]
    p = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log, t0 = tmp_path / "train.log", time.time()
    while not log.exists() or "step    3/" not in log.read_text():
        assert time.time() - t0 < 120 and p.poll() is None, "run did not start"
        time.sleep(0.1)
    sigkill_tree(p)
    with h5py.File(tmp_path / "local.h5", "r", swmr=True) as f:     # committed step rows
        before = dict(zip(f["commit"].attrs["tables"], f["commit"][:]))["/steps/speaker"]
    assert 3 <= before < STEPS

    q = run_training(tmp_path, *SMALL, f"run.steps={STEPS}", "run.checkpoint_every=0")
    assert "resumed at versions {'speaker': 0, 'listener': 0}" in q.stdout, q.stdout
    assert "cleared the open-for-write flags" in q.stdout
    check_exactly_once(tmp_path / "local.h5", STEPS)
    with h5py.File(tmp_path / "local.h5", "r") as f:
        st = f["steps/speaker"][:]
        assert (st["superseded"] == 1).sum() == before          # the first attempt's rows
    s = summary(load_run(tmp_path / "local.h5"))
    assert s["steps_done"] == STEPS and s["per_agent"]["speaker"]["steps"] == STEPS


def test_a_kill_inside_a_chunk_rewrite_resumes_with_nothing_lost(tmp_path, mpiexec, monkeypatch):
    """The store_torn fault: the orchestrator dies with a table's last chunk rewritten (new
    rows, old checksum: a kill inside the write) and /commit not yet written. The same
    command mends the chunk (its committed rows match /commit_crc) and loses nothing."""
    monkeypatch.setenv("FLEXMARL_FAULT", "store_torn:80:0")
    p = run_training(tmp_path, *SMALL, f"run.steps={STEPS}", "run.checkpoint_every=0", check=False)
    assert p.returncode != 0, p.stdout[-2000:]
    monkeypatch.delenv("FLEXMARL_FAULT")
    q = run_training(tmp_path, *SMALL, f"run.steps={STEPS}", "run.checkpoint_every=0", check=False)
    assert q.returncode == 0, (q.stdout[-3000:], q.stderr[-3000:])
    assert "rewrote the torn chunk of" in q.stdout, q.stdout[-3000:]
    check_exactly_once(tmp_path / "local.h5", STEPS)
