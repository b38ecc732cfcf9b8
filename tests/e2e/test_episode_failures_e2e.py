"""Issue 40 end to end (tests/e2e/episodes.py, the tiny chat model of test_episodes_e2e): an
episode function that always fails stops the run at its first step, one line saying why and
the traceback, exit 1 (not 75: a requeue would fail again), the store flushed; one that fails
one episode in ten trains on with the failed calls dropped, and `analyze` and `status` show
the failures by kind."""
from __future__ import annotations

import os
import subprocess
import sys

import h5py
import numpy as np

from tests.conftest import ROOT, run_training
from tests.helpers import check_exactly_once, check_journal

DROPPED = 3


def overrides(tiny_chat, episode, steps):
    model, data = tiny_chat
    return ["run.name=ep", f"workflow.episode=tests.e2e.episodes:{episode}", "workflow.agents=[planner]",
            "workflow.inputs_per_step=5", "workflow.group_size=2", "workflow.max_new_tokens=8",
            f"workflow.dataset.train={data}", "workflow.dataset.eval=", "workflow.dataset.shuffle=false",
            f"model.checkpoint={model}", "rollout.max_model_len=512", f"run.steps={steps}", "run.log_every=1",
            "trainer.micro_batch_size=4"]


def cli(module, *args):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)


def test_a_run_whose_episodes_all_fail_stops_with_the_traceback_and_exit_1(tmp_path, mpiexec, tiny_chat):
    p = run_training(tmp_path, *overrides(tiny_chat, "fails_always", 3), config="configs/math_team.yaml",
                     check=False)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    stop = [ln for ln in p.stdout.splitlines() if ln.startswith("stopping the run:")]
    assert stop == ["stopping the run: 6 of the 10 episodes of step 0 failed (ValueError 6), more than "
                    "workflow.max_failure_rate=0.5; first (example 0, episode 0): ValueError: ctx.chat: no "
                    "agent 'critic' (workflow.agents: ['planner'])"], p.stdout[-3000:]
    after = p.stdout.split(stop[0], 1)[1]
    assert after.lstrip("\n").startswith("Traceback (most recent call last)") and "fails_always" in after
    assert "exiting 1 (checkpointed, store flushed" in after
    log = (tmp_path / "train.log").read_text()
    assert stop[0] in log and log.count("episode failed (first ValueError)") == 1
    check_journal(tmp_path / "ep.h5")
    with h5py.File(tmp_path / "ep.h5", "r") as f:           # the store was flushed at the stop
        commit = dict(zip(f["commit"].attrs["tables"], f["commit"][:]))
        assert commit["/failures"] >= 6 and set(f["failures"]["kind"][:]) == {b"ValueError"}
    assert (tmp_path / "checkpoints" / "planner").is_dir()


def test_one_failed_episode_in_ten_is_dropped_and_analyze_and_status_show_the_kinds(tmp_path, mpiexec, tiny_chat):
    p = run_training(tmp_path, *overrides(tiny_chat, "fails_one_in_ten", 2), config="configs/math_team.yaml")
    assert "step    2/2" in p.stdout, p.stdout[-3000:]
    assert "step 0: 1 of 10 episodes failed (KeyError 1)" in p.stdout
    assert "step 1: 1 of 10 episodes failed (KeyError 1)" in p.stdout
    check_exactly_once(tmp_path / "ep.h5", 2, dropped_ok=True)
    with h5py.File(tmp_path / "ep.h5", "r") as f:
        s = f["samples/planner"][:]
        fails = f["failures"][:]
        steps = f["steps/planner"][:]
    dropped = s[s["status"] == DROPPED]
    assert sorted(zip(dropped["input_id"].tolist(), dropped["traj"].tolist())) == [(0, 0), (5, 0)]
    assert sorted(zip(fails["input_id"].tolist(), fails["traj"].tolist())) == [(0, 0), (5, 0)]
    assert steps[steps["superseded"] == 0]["n_samples"].tolist() == [9, 9]
    assert np.isfinite(s["reward"][s["status"] != DROPPED]).all()
    out = cli("flexmarl_hpc.analyze", tmp_path / "ep.h5", "--out", tmp_path / "figs")
    assert out.returncode == 0, out.stderr
    assert "failed episodes: 2 (KeyError 2); their calls dropped: 2" in out.stdout, out.stdout
    assert "first KeyError: 'no_such_key'" in out.stdout and "over-provisioning" not in out.stdout
    st = cli("flexmarl_hpc.status", tmp_path)
    assert "failed 2 episodes: KeyError 2" in st.stdout, st.stdout + st.stderr
