"""The journal hook of the mpi, e2e and Slurm tiers (tests/journal_hook.py), loaded alone
into an inner pytest session (pytester, in-process): a passing test whose store breaks the
journal rule errors, naming the store and the rule; a damages_store test and a test that
fails are left alone; a marker without its reason is refused; a store whose writer was
killed before it switched to SWMR is read with its bytes unchanged. And its scan on its own:
only stores new or changed since the test began count; a non-store HDF5 file and a file
that is no HDF5 file are left alone."""
import hashlib

import h5py
import pytest

from flexmarl_hpc.orchestrator.experience import Journal
from flexmarl_hpc.orchestrator.tree import Node
from flexmarl_hpc.store.schema import CONSUMED, READY
from flexmarl_hpc.store.tables import StoreFile
from tests.helpers import check_stores_changed, h5_mtimes, in_child_then_kill, journal_store

pytest_plugins = ["pytester"]

INNER = '''
import h5py, pytest
from tests.helpers import journal_store
pytestmark = pytest.mark.e2e                  # a journal tier, as the folder gives it outside

def test_good(tmp_path):
    journal_store(tmp_path / "run.h5")

def test_bad(tmp_path):
    journal_store(tmp_path / "run.h5", ready=False)

@pytest.mark.damages_store("forges a sample consumed without its reward")
def test_bad_on_purpose(tmp_path):
    journal_store(tmp_path / "run.h5", ready=False)

def test_bad_and_failing(tmp_path):
    journal_store(tmp_path / "run.h5", ready=False)
    assert False, "the test's own failure"

def test_not_a_store(tmp_path):
    with h5py.File(tmp_path / "weights.h5", "w") as f:
        f["w"] = [1.0]

@pytest.fixture(scope="module")
def fixture_run(tmp_path_factory):             # a module fixture's run, set up for the next test
    journal_store(tmp_path_factory.mktemp("fixture_run") / "run.h5", ready=False)

def test_on_a_fixture_run(fixture_run):
    pass
'''


def test_a_passing_test_whose_store_breaks_the_rule_errors_naming_store_and_rule(pytester):
    pytester.makepyfile(test_inner=INNER)
    r = pytester.runpytest_inprocess("-p", "tests.journal_hook", "-q", "-p", "no:cacheprovider")
    r.assert_outcomes(passed=5, failed=1, errors=2)
    err = {rep.nodeid.split("::")[1]: rep.longreprtext for rep in r.reprec.getreports("pytest_runtest_logreport")
           if rep.when == "teardown" and rep.failed}
    assert sorted(err) == ["test_bad", "test_on_a_fixture_run"]
    assert "test_bad0/run.h5 breaks the journal rule (generated -> ready -> consumed" in err["test_bad"]
    assert "a sample 0_0: event 2 after 0" in err["test_bad"]
    assert "fixture_run0/run.h5 breaks the journal rule" in err["test_on_a_fixture_run"]


def test_a_damages_store_marker_needs_its_reason(pytester):
    pytester.makepyfile(test_inner="import pytest\n@pytest.mark.damages_store\ndef test_x():\n    pass\n")
    r = pytester.runpytest_inprocess("-p", "tests.journal_hook", "-q", "-p", "no:cacheprovider")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*test_x: @pytest.mark.damages_store needs its reason*"])


@pytest.mark.parametrize("ready", [True, False])
def test_a_store_killed_open_for_write_is_checked_with_its_bytes_unchanged(tmp_path, ready):
    path = tmp_path / "run.h5"
    journal_store(path, ready)
    in_child_then_kill(lambda: h5py.File(path, "a"))        # flagged open for write, never SWMR
    with pytest.raises(OSError, match="already open for write"):
        h5py.File(path, "r")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if ready:
        assert check_stores_changed(tmp_path, {}) == 1
    else:
        with pytest.raises(AssertionError, match="run.h5 breaks the journal rule"):
            check_stores_changed(tmp_path, {})
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


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
    with pytest.raises(AssertionError, match=r"bad.h5 breaks the journal rule .*a sample 3_0_0: event 2 after 0"):
        check_stores_changed(tmp_path, before)
