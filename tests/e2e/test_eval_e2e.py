"""Held-out evaluation (run.eval_every) in real runs: training must not change with evaluation
on, and the /eval rows reach the log line, analyze and status (the pure bookkeeping, greedy
sampling, the /eval table and the start-up checks: tests/unit/test_eval.py)."""
import subprocess
import sys

import h5py
import pytest

from tests.conftest import ROOT, run_training
from tests.helpers import SMALL, assert_same_run

EVAL = ["run.eval_every=2", "run.eval_inputs=8", "run.eval_samples=2"]
FLEX = [*SMALL, "run.mode=flex", "rollout.replicas=2", "rollout.max_batch=8"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mpiexec):
    off, on = tmp_path_factory.mktemp("eval_off"), tmp_path_factory.mktemp("eval_on")
    run_training(off, *FLEX)
    p = run_training(on, *FLEX, *EVAL)
    return off, on, p


def test_training_is_the_same_with_and_without_evaluation(runs):
    """Staleness 0: the same sample ids with the same tokens and versions, the same final
    weights, and no evaluation sample in the training tables."""
    off, on, _ = runs
    assert_same_run(off, on)
    with h5py.File(on / "local.h5") as f:
        for agent in ("speaker", "listener"):
            assert not any(sid.startswith(b"eval") for sid in f[f"samples/{agent}"]["sample_id"][:])


def test_eval_rows_log_line_and_analyze(runs, tmp_path):
    _, on, p = runs
    with h5py.File(on / "local.h5") as f:
        ev = f["eval"][:]
    assert sorted(set(ev["step"].tolist())) == [0, 2, 4, 6]
    assert (ev["version"] == ev["step"]).all() and (ev["n_inputs"] == 8).all()
    for step in (0, 2, 4, 6):
        mine = ev[ev["step"] == step]
        assert {(a, m) for a, m in zip(mine["agent"], mine["mode"])} == {
            (a, m) for a in (b"speaker", b"listener") for m in (b"greedy", b"sample")}
        assert set(mine["n_paths"][mine["mode"] == b"sample"]) == {16}
    assert ((ev["value"] >= 0) & (ev["value"] <= 1)).all()
    assert "eval at step    6 |" in p.stdout and "speaker/reward" in p.stdout
    cmd = [sys.executable, "-m", "flexmarl_hpc.analyze", str(on / "local.h5")]
    out = subprocess.run([*cmd, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    import json
    curves = json.loads(out.stdout)["eval"]
    assert set(curves) == {"speaker/reward", "listener/reward", "speaker/reward/sample",
                           "listener/reward/sample"}
    assert curves["listener/reward"]["step"] == [0, 2, 4, 6]
    subprocess.run([*cmd, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, timeout=180, check=True)
    assert (tmp_path / "eval.png").stat().st_size > 10_000
    st = subprocess.run([sys.executable, "-m", "flexmarl_hpc.status", str(on)], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
    assert "eval   listener step 6" in st.stdout, st.stdout
