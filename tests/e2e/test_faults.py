"""Short form of scripts/faults.py: one SIGKILL per role (orchestrator mid HDF5 append, replica,
trainer leader mid checkpoint write, trainer member), each followed by the same command until
it exits 0, then the h5py-only reader finds nothing lost or trained twice. The reader is then
shown a damaged copy (a sample trained by two steps, a status without its event) and
must report both, so it can fail."""
import argparse
import shutil
import sys

import h5py
import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import faults  # noqa: E402  (scripts/faults.py)

# (role, rank, hook, count, delay): a hook's count-th pass, or (no hook) `delay` s after step
# `count` is logged, so the kill lands mid-training whatever the machine's load
PLAN = [("orchestrator", 0, "store_append", 60, 0), ("replica", 1, None, 10, 0.3),
        ("trainer leader", 2, "checkpoint_write", 2, 0), ("trainer member", 5, None, 20, 0.2)]


@pytest.mark.damages_store("bad.h5: a copy forged to train a sample twice and mark one ready without its event")
def test_one_kill_per_role_resumes_with_nothing_lost(tmp_path, mpiexec):
    args = argparse.Namespace(out=tmp_path, bound=60, timeout=900)
    for n, plan_row in enumerate(PLAN):
        _, role, rank, row, tries, err, chk = faults.trial(args, n, plan_row)
        assert row["killed"] and row["rc"] != 0, (role, row)
        assert not row["hang"], f"{role}: a rank outlived the kill by {args.bound}s"
        assert tries == 1, f"{role} killed at {row['moment']}: the same command did not resume: {err}"
        assert chk == {"lost": 0, "twice": 0, "status_errors": 0, "problems": []}, (role, row, chk)

    bad = tmp_path / "bad.h5"
    shutil.copy(tmp_path / "fault_0" / "local.h5", bad)
    with h5py.File(bad, "r+") as f:
        st = f["steps/speaker"][:]
        first, second = (st[(st["superseded"] == 0) & (st["step"] == k)][0] for k in (0, 1))
        pool = f["step_rows/speaker"]                # step 1 trains a sample of step 0 again
        pool[second["rows_offset"]] = pool[first["rows_offset"]]
        s = f["samples/listener"]
        rec = s[0]
        rec["status"] = 1                            # ready without its event
        s[0] = rec
    chk = faults.check_store(bad)
    assert chk["twice"] == 1 and chk["lost"] == 1 and chk["status_errors"] >= 1, chk
