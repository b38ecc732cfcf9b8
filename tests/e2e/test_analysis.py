"""Post-hoc analysis of real runs: summary numbers checked against raw h5py reads."""
import json
import os
import shutil
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from flexmarl_hpc.analysis.load import AnalysisError, load_run, summary, utilization
from flexmarl_hpc.analyze import main as analyze_main
from tests.conftest import ROOT, run_training

SMALL = ["run.steps=5", "workflow.inputs_per_step=4", "trainer.micro_batch_size=8",
         "model.hidden_size=32", "model.intermediate_size=64"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, mpiexec):
    out = tmp_path_factory.mktemp("runs")
    run_training(out / "sync", *SMALL, "run.mode=sync")
    run_training(out / "flex", *SMALL, "run.mode=flex", "rollout.replicas=2")
    return out / "sync" / "local.h5", out / "flex" / "local.h5"


def test_summary_agrees_with_raw_datasets(two_runs):
    path = two_runs[0]
    s = summary(load_run(path))
    with h5py.File(path, "r") as f:
        for agent in ("speaker", "listener"):
            r = f[f"steps/{agent}"]["reward_mean"]
            assert s["per_agent"][agent]["reward_first"] == pytest.approx(r[0])
            assert s["per_agent"][agent]["reward_last"] == pytest.approx(r[-1])
            assert s["per_agent"][agent]["reward_best"] == pytest.approx(r.max())
        n = sum(len(f[f"samples/{a}"]) for a in ("speaker", "listener"))
        iv = f["intervals"][:]
        t0, t1, role, act, rank = (iv[c] for c in ("t0", "t1", "role", "activity", "rank"))
        wall = t1.max() - t0.min()
        busy = act != b"wait"
        for r in (b"rollout", b"trainer"):
            sel = (role == r) & busy
            expect = (t1[sel] - t0[sel]).sum() / (len(set(rank[role == r])) * wall)
            assert s["utilization"][r.decode()] == pytest.approx(expect, rel=1e-6)
        stale = np.concatenate([f[f"samples/{a}"]["trainer_step"] - f[f"samples/{a}"]["policy_version"]
                                for a in ("speaker", "listener")])
    assert s["samples"] == n and s["steps_done"] == 5
    assert s["samples_per_s"] == pytest.approx(n / wall)
    assert s["staleness"] == {int(k): int(v) for k, v in zip(*np.unique(stale, return_counts=True))}
    assert s["mode"] == "sync" and s["agents"] == ["speaker", "listener"]


def test_figures_and_side_by_side(two_runs, tmp_path, capsys):
    assert analyze_main([str(two_runs[0]), str(two_runs[1]), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "comparison vs" in out and "sync/local (sync)" in out and "flex/local (flex)" in out
    names = {"rewards.png", "entropy_kl.png", "timeline.png", "utilization.png", "staleness.png",
             "response_lengths.png", "replica_load.png"}
    assert names <= {p.name for p in tmp_path.iterdir()}
    for n in names:
        data = (tmp_path / n).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, n


def test_json_summary(two_runs, capsys):
    assert analyze_main([str(two_runs[1]), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["mode"] == "flex" and s["steps_done"] == 5 and set(s["per_agent"]) == {"speaker", "listener"}


def test_utilization_over_time_bins(two_runs):
    u = utilization(load_run(two_runs[1]), by="role", bins=10)
    assert list(u.columns) == ["orchestrator", "rollout", "trainer"] and len(u) == 10
    assert ((u >= 0) & (u <= 1 + 1e-9)).all().all()


def _expect_error(path, capsys, needle):
    assert analyze_main([str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert err.count("\n") == 1


@pytest.mark.damages_store("copies of a store with an old schema, a table deleted, or cut in half")
def test_bad_inputs_give_one_clear_line(two_runs, tmp_path, capsys):
    _expect_error(tmp_path / "missing.h5", capsys, "no such file")
    (tmp_path / "text.h5").write_text("not hdf5")
    _expect_error(tmp_path / "text.h5", capsys, "not a readable HDF5 file")
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = [1, 2]
    _expect_error(tmp_path / "other.h5", capsys, "not a flexmarl_hpc run file")
    old = tmp_path / "old.h5"
    shutil.copy(two_runs[0], old)
    with h5py.File(old, "a") as f:
        f.attrs["schema_version"] = 0
    _expect_error(old, capsys, "schema version 0; this flexmarl_hpc reads schema versions 1, 2")
    holed = tmp_path / "holed.h5"
    shutil.copy(two_runs[0], holed)
    with h5py.File(holed, "a") as f:
        del f["steps/listener"]
    _expect_error(holed, capsys, "missing dataset /steps/listener")
    cut = tmp_path / "cut.h5"
    data = two_runs[0].read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    assert analyze_main([str(cut)]) == 2
    assert "Traceback" not in capsys.readouterr().err
    with pytest.raises(AnalysisError):
        load_run(cut)


def test_reads_a_run_while_it_is_written(tmp_path, mpiexec):
    args = [sys.executable, "-m", "flexmarl_hpc.run", "configs/local.yaml", f"run.output_dir={tmp_path}",
            *SMALL, "run.steps=40"]
    p = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    path, seen = tmp_path / "local.h5", []
    t0 = time.time()
    try:
        while p.poll() is None and time.time() - t0 < 180:
            if path.exists():
                try:
                    seen.append(len(load_run(path).samples))
                except AnalysisError:
                    pass                               # before the writer switched to SWMR
            time.sleep(0.3)
    finally:
        out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    assert len({n for n in seen if n > 0}) >= 2, seen
