"""trainer.ppo_epochs in real runs: two passes per batch record the clip fraction, and a kill
between a replay pass and its optimizer step redoes the step from the checkpoint (the clip by
hand and the replay on a real TorchTrainer: tests/unit/test_ppo_epochs.py)."""
import re

import h5py
import numpy as np
import torch

from tests.conftest import run_training


def test_run_with_two_epochs_records_the_clip_fraction(tmp_path, mpiexec):
    """A real flex run (micro-batch overlap on) with ppo_epochs=2: completes, one /steps row
    per step and version, clip_frac / ppo_kl recorded (non-zero somewhere: the second pass
    moves the ratio), every sample trained exactly once."""
    from tests.helpers import SMALL, check_exactly_once
    run_training(tmp_path, *SMALL, "run.mode=flex", "trainer.ppo_epochs=2", "trainer.lr=3e-3",
                 "trainer.clip_eps=0.02", "trainer.micro_batch_size=4")
    check_exactly_once(tmp_path / "local.h5", 6)
    with h5py.File(tmp_path / "local.h5", "r") as f:
        for agent in f.attrs["agents"]:
            st = f[f"steps/{agent}"][:]
            st = st[st["superseded"] == 0]
            assert st["version"].tolist() == list(range(1, 7))
            assert (st["n_micro"] > 1).all()            # pass 1 came in several micro-batches
            assert np.isfinite(st["clip_frac"]).all() and (st["clip_frac"] >= 0).all()
            assert (st["clip_frac"] > 0).any() and (st["ppo_kl"] != 0).any(), st[["clip_frac", "ppo_kl"]]
    from flexmarl_hpc.analysis.load import load_run
    run = load_run(tmp_path / "local.h5")
    assert "clip_frac" in run.steps.columns


def test_kill_during_the_replay_redoes_the_step_from_the_checkpoint(tmp_path, mpiexec, monkeypatch):
    """A trainer rank SIGKILLed between a replay pass and its optimizer step (step 3, after
    the checkpoint at version 2): the step was never reported, so resuming from the
    checkpoint redoes it; every sample is trained exactly once and the result is bit for
    bit the uninterrupted run (sync mode is deterministic)."""
    from tests.helpers import SMALL, check_exactly_once, final_weights
    common = [*SMALL, "run.mode=sync", "trainer.ppo_epochs=2", "run.checkpoint_every=2"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    run_training(ref, *common)
    monkeypatch.setenv("FLEXMARL_FAULT", "ppo_replay:4:2")        # rank 2: the speaker's group
    p = run_training(out, *common, check=False)
    assert p.returncode != 0
    with h5py.File(out / "local.h5", "r", swmr=True) as f:     # left open-for-write by the kill
        done = dict(zip(f["commit"].attrs["tables"], f["commit"][:]))["/steps/speaker"]
    assert done == 3, done                                         # killed in its 4th step
    monkeypatch.delenv("FLEXMARL_FAULT")
    q = run_training(out, *common)
    # the speaker redoes its step from version 2; the listener trained its step 4 beside it
    # (sync mode) and is at 2 or 4: its checkpoint of version 4 (checkpoint_every=2, sent as
    # the step ends) races mpiexec ending the job after the kill, and either is a checkpoint
    # of the uninterrupted run
    resumed = re.search(r"resumed at versions \{'speaker': 2, 'listener': [24]\}", q.stdout)
    assert resumed, q.stdout[-2000:]
    print(resumed.group(0))
    check_exactly_once(out / "local.h5", 6)
    for agent in ("speaker", "listener"):
        a, b = final_weights(ref, agent), final_weights(out, agent)
        assert int(a["version"]) == int(b["version"]) == 6
        for k in a:
            if k.startswith("model.") or k.startswith("optim."):
                assert torch.equal(a[k], b[k]), (agent, k)
