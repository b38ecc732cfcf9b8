"""The journal check every mpi/e2e/slurm test gets (tests/conftest.py _journal_rule): it
finds the stores a test wrote by file and mtime, holds each to the journal rule, and can fail:
a sample consumed without a READY event is caught; an unchanged store, a non-store HDF5 file
and a file HDF5 cannot open are left alone."""
from __future__ import annotations

import h5py
import pytest

from flexmarl_hpc.orchestrator.experience import Journal
from flexmarl_hpc.orchestrator.tree import Node
from flexmarl_hpc.store.schema import CONSUMED, READY
from flexmarl_hpc.store.tables import StoreFile
from tests.helpers import check_stores_changed, h5_mtimes


def store(path, ready: bool):
    s = StoreFile(path, ["a"], {})
    j = Journal(s)
    nodes = [Node("a", 0, 0, 3, t, None, [], None, prompt=[1, 2], response=[3], logprobs=[-0.5], version=0,
                  replica=1) for t in range(2)]
    j.generated(nodes, now=1.0)
    for n in nodes:
        n.reward, n.advantage = 1.0, 0.5
    if ready:
        j.status(nodes, READY, now=2.0)
    j.status(nodes, CONSUMED, now=3.0, trainer_step=0)
    s.close()


def test_only_new_or_changed_stores_are_checked_and_a_reward_less_consumption_fails(tmp_path):
    store(tmp_path / "good.h5", ready=True)
    store(tmp_path / "old_bad.h5", ready=False)       # written before the test: not its store
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = [1]
    (tmp_path / "text.h5").write_text("not hdf5")
    before = h5_mtimes(tmp_path)
    assert check_stores_changed(tmp_path, before) == 0
    (tmp_path / "sub").mkdir()
    store(tmp_path / "sub" / "new.h5", ready=True)
    assert check_stores_changed(tmp_path, before) == 1
    store(tmp_path / "bad.h5", ready=False)
    with pytest.raises(AssertionError, match=r"a sample 3_0_0: event 2 after 0"):
        check_stores_changed(tmp_path, before)
