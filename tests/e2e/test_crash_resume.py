"""End to end: every rank SIGKILLed mid-run (no checkpoint, the default), and the same
command resumes: the store is re-opened (flags cleared, torn rows discarded), reconciled
with version 0, rolled-back step rows marked superseded, every sample trained exactly once."""
import os
import random
import re
import signal
import subprocess
import sys
import time

import h5py
import pytest

from flexmarl_hpc.analysis.load import load_run, summary
from flexmarl_hpc.store.schema import CONSUMED, DROPPED
from tests.conftest import ROOT, run_training
from tests.helpers import SMALL, check_batches_of_whole_inputs, check_exactly_once, sigkill_tree

STEPS = 12


def test_sigkill_without_a_checkpoint_resumes_with_nothing_lost(tmp_path, mpiexec):
    """...and a resume that hangs (a trainer stalled after its build, so start-up waits for
    it) ends on SIGTERM within seconds with the requeue code, instead of waiting out
    run.build_timeout_s (issue 38: signals always work); the store stays resumable."""
    args = [sys.executable, "-m", "flexmarl_hpc.run", "configs/local.yaml", f"run.output_dir={tmp_path}",
            *SMALL, f"run.steps={STEPS}", "run.checkpoint_every=0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen(args, cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log, t0 = tmp_path / "train.log", time.time()
    while not log.exists() or "step    3/" not in log.read_text():
        assert time.time() - t0 < 120 and p.poll() is None, "run did not start"
        time.sleep(0.1)
    sigkill_tree(p)
    with h5py.File(tmp_path / "local.h5", "r", swmr=True) as f:     # committed step rows
        before = dict(zip(f["commit"].attrs["tables"], f["commit"][:]))["/steps/speaker"]
    assert 3 <= before < STEPS

    hung = subprocess.Popen(args, cwd=ROOT, env={**env, "FLEXMARL_FAULT": "build:1:1:stall"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    t0 = time.time()
    while log.read_text().count("local: mode flex") < 2:       # the resume's orchestrator is up
        assert time.time() - t0 < 120 and hung.poll() is None, "the resume did not start"
        time.sleep(0.1)
    time.sleep(1.0)                                          # rank 0 waits for the stalled trainer
    os.killpg(hung.pid, signal.SIGTERM)                      # as Slurm signals every task
    try:
        out, _ = hung.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        sigkill_tree(hung)
        pytest.fail("SIGTERM did not end a resume hung in start-up (it waits for run.build_timeout_s)")
    assert hung.returncode == 75, out[-3000:]
    assert "preemption signal during start-up" in log.read_text(), out[-3000:]

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


@pytest.mark.parametrize("seed,ckpt", [(11, 0), (29, 7)], ids=["no-checkpoint", "checkpoint-every-7"])
def test_sigkill_of_an_overprovisioned_run_trains_every_input_once(tmp_path, mpiexec, seed, ckpt):
    """pipeline.overprovision=2 (6 inputs admitted a step, the first 4 trees to finish
    trained, 2 dropped) SIGKILLed, process tree and all, at a seeded moment: after a
    seeded step's log line plus a seeded delay. A DROPPED event waits for the next flush
    that writes, so the kill can fall between a drop and its event. The same command then
    resumes, and a reader of the file alone (h5py) finds every input trained exactly once,
    by its own step and whole, the dropped inputs never trained, and an event behind every
    status."""
    rng = random.Random(seed)
    steps = 120                             # a step takes ~30 ms on 2 idle cores: room for the kill
    at, delay = rng.randint(5, 40), rng.uniform(0.0, 0.5)
    over = [*SMALL, f"run.steps={steps}", f"run.checkpoint_every={ckpt}", "pipeline.overprovision=2"]
    args = [sys.executable, "-m", "flexmarl_hpc.run", "configs/local.yaml", f"run.output_dir={tmp_path}", *over]
    p = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log, t0 = tmp_path / "train.log", time.time()
    while not log.exists() or not re.search(rf"step +{at}/", log.read_text()):
        assert time.time() - t0 < 240 and p.poll() is None, f"run did not reach step {at}"
        time.sleep(0.01)
    time.sleep(delay)
    sigkill_tree(p)
    with h5py.File(tmp_path / "local.h5", "r", swmr=True) as f:
        before = dict(zip(f["commit"].attrs["tables"], f["commit"][:]))["/steps/speaker"]
    assert before < steps, "the kill came after the run's end"

    q = run_training(tmp_path, *over, check=False, timeout=600)      # the same command
    assert q.returncode == 0, (q.stdout[-3000:], q.stderr[-3000:])
    assert "resumed at versions" in q.stdout, q.stdout[-3000:]
    path = tmp_path / "local.h5"
    check_exactly_once(path, steps, dropped_ok=True)
    check_batches_of_whole_inputs(path, inputs=4, extra=2)
    check_events_alone(path)


def check_events_alone(path):
    """From /events and the current /steps rows only (not the status cache): the consumed
    rows are exactly the rows the steps trained, each consumed by its own step's trainer,
    and at least one sample was dropped (the over-provisioning really dropped)."""
    with h5py.File(path, "r") as f:
        agents = list(f.attrs["agents"])
        ev = f["events"][:]
        dropped = 0
        for i, agent in enumerate(agents):
            e = ev[ev["agent"] == i]
            last = {}
            for row, status, tstep in zip(e["row"].tolist(), e["status"].tolist(), e["trainer_step"].tolist()):
                last[row] = (status, tstep)
            consumed = sorted(r for r, (s, _) in last.items() if s == CONSUMED)
            dropped += sum(s == DROPPED for s, _ in last.values())
            st = f[f"steps/{agent}"][:]
            st = st[st["superseded"] == 0]
            pool = f[f"step_rows/{agent}"][:]
            by_step = {int(s): pool[o:o + n].tolist() for s, o, n in zip(st["step"], st["rows_offset"], st["rows_len"])}
            assert sorted(r for rows in by_step.values() for r in rows) == consumed, agent
            assert all(last[r][1] == s for s, rows in by_step.items() for r in rows), agent
        assert dropped > 0, "nothing was dropped: the test did not exercise over-provisioning"
