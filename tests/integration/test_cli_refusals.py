"""Malformed inputs through real processes: the real entry point (`python -m flexmarl_hpc.run`,
`python -m flexmarl_hpc.analyze`) refuses them with rc 2 and one stderr line, no traceback, no
mpiexec and nothing written; a read-only mount (mounted for the test) is refused before
launch; an episode module whose import hangs is bounded (its check runs in a child). The
in-process refusals, one per row of the table: tests/unit/test_bad_inputs.py.

    pytest tests/integration/test_cli_refusals.py
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.helpers import CASES, LOCAL, bad_input_args, nothing_written, refused_in_process


@pytest.fixture
def read_only_mount(tmp_path):
    """A tmpfs mounted read-only at tmp_path/ro (needs root and mount); unmounted after."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    try:
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], check=True)


@pytest.mark.parametrize("sub", ["", "run"])
def test_output_dir_on_a_read_only_mount(read_only_mount, sub, tmp_path, capsys, monkeypatch):
    """EROFS after every rank had started; now refused before, for the mount itself and for a
    folder to be created in it."""
    out = read_only_mount / sub if sub else read_only_mount
    refused_in_process(f"output_dir=ro/{sub}", [LOCAL, f"run.output_dir={out}"],
                       f"run.output_dir: {read_only_mount} is on a read-only file system", tmp_path, capsys, monkeypatch)


SUBPROCESS_CASES = ["non-utf8-file", "num_heads=0", "lr=nan", "replicas=100000-local", "name-newline",
                    "yaml-alias-bomb", "yaml-nested-5000", "num_objects=0", "inputs_per_step=10**8"]


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_refused_from_the_command_line(name, tmp_path):
    """The real entry point: rc 2, one stderr line, no traceback, no mpiexec."""
    argv, field = bad_input_args(next(c for c in CASES if c[0] == name), tmp_path)
    before = set(tmp_path.rglob("*"))
    p = subprocess.run([sys.executable, "-m", "flexmarl_hpc.run", *argv], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.startswith(f"config error: {field}") and p.stderr.count("\n") == 1, p.stderr
    assert "launching" not in p.stdout and "Traceback" not in p.stderr
    nothing_written(tmp_path, before)


@pytest.fixture(scope="module")
def store_file(tmp_path_factory):
    """A small real run file (StoreFile, the writer of runs) with a few rows."""
    pytest.importorskip("h5py")
    from flexmarl_hpc.store.tables import StoreFile
    from flexmarl_hpc.store.schema import METRIC_COLUMNS
    path = tmp_path_factory.mktemp("store") / "r.h5"
    s = StoreFile(path, ["a"], {"config_yaml": "{}", "mode": "flex", "world_size": 3}, chunk=16)
    s.metrics.append({k: [0, 1] for k in METRIC_COLUMNS})
    s.flush()
    s.close()
    return path


@pytest.mark.parametrize("keep", [8, 9, 12, 20, 47, 0.5, -100])
def test_truncated_hdf5_to_analyze(store_file, tmp_path, keep):
    """Cut anywhere (inside the superblock too, where the reader used to hang or raise
    IndexError): one line naming the file, rc 2."""
    data = store_file.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (keep if keep > 0 else len(data) + keep)
    cut = tmp_path / "cut.h5"
    cut.write_bytes(data[:n])
    p = subprocess.run([sys.executable, "-m", "flexmarl_hpc.analyze", str(cut), "--no-plots"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    print(f"truncated to {n} bytes -> {p.stderr.strip()}")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.startswith(f"analyze: {cut}:") and p.stderr.count("\n") == 1, p.stderr
    assert "Traceback" not in p.stderr


def test_the_episode_check_passes_good_args_and_bounds_a_hanging_import(tmp_path, monkeypatch):
    """Declared args of the right types pass (an int for a float field too), an episode
    without ARGS takes any args, and an import that hangs is one line, not a hung launcher."""
    from flexmarl_hpc.config.schema import ConfigError
    from flexmarl_hpc.workflows.episode_check import check_episode
    check_episode("flexmarl_hpc.workflows.math_team:episode", {"extra_solver_cost": 0.02})
    check_episode("flexmarl_hpc.workflows.math_team:episode", {"extra_solver_cost": 0})
    check_episode("tests.e2e.episodes:skewed", {"anything": [1, 2]})
    (tmp_path / "hangs_ep.py").write_text("import time\ntime.sleep(3600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^workflow.episode: importing 'hangs_ep:episode' did not finish in 3 s$"):
        check_episode("hangs_ep:episode", {}, timeout=3)
