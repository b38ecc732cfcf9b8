"""The journal rule over every run store of the mpi, e2e and Slurm tiers (issue 35), as a
pytest plugin: tests/conftest.py imports its hooks and fixture, and a unit test loads it
alone into an inner pytest session (tests/unit/test_journal_hook.py).

After each passing test of those tiers, every run store (an HDF5 file with /commit and
/events; checkpoints and sinks are left out) under the session's pytest tmp folder that is
new or changed since the test's setup began is checked by tests/helpers.py check_journal,
whatever wrote it: run_training, a Popen'd CLI, srun, a killed job never resumed (read with
its open-for-write flags ignored, the file unchanged: helpers.open_readonly). The folder is
the session's, not the test's tmp_path, so module fixtures' runs count too; by file and
mtime, so a store an earlier test left damaged is not counted as this one's.

A test that damages or forges a store on purpose says so with
@pytest.mark.damages_store("why"), the reason required, and its stores are not checked.
A failing test's stores are not checked either: a second error would only hide the first.
"""
from __future__ import annotations

import pytest

JOURNAL_TIERS = ("mpi", "e2e", "slurm")


def _journal_tier(item) -> bool:
    return any(item.get_closest_marker(m) for m in JOURNAL_TIERS)


def pytest_collection_modifyitems(config, items):
    check_marker_reasons(items)


def check_marker_reasons(items) -> None:
    """A damages_store marker without its reason is a usage error, not a silent opt-out."""
    for item in items:
        m = item.get_closest_marker("damages_store")
        if m is not None and not (m.args and isinstance(m.args[0], str) and m.args[0].strip()):
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.damages_store needs its reason, "
                                    f'e.g. damages_store("truncates a copy of the store")')


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the item, so the journal check runs only after a test
    that passed (tests/slurm/conftest.py reads it too, to show a failed job's logs)."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"_report_{rep.when}", rep)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """The stores' mtimes before any fixture of the test is set up: a module fixture's run,
    set up for this test, is then this test's to answer for."""
    if _journal_tier(item):
        from tests.helpers import h5_mtimes
        # the tmp_path_factory fixture is this object; fixtures are not set up yet
        item._h5_before = h5_mtimes(item.config._tmp_path_factory.getbasetemp())


@pytest.fixture(autouse=True)
def _journal_rule(request, tmp_path_factory):
    """Torn down after the test's other function fixtures (autouse: set up first)."""
    yield
    node = request.node
    before = getattr(node, "_h5_before", None)
    rep = getattr(node, "_report_call", None)
    if before is None or rep is None or not rep.passed or node.get_closest_marker("damages_store"):
        return
    from tests.helpers import check_stores_changed
    check_stores_changed(tmp_path_factory.getbasetemp(), before)
