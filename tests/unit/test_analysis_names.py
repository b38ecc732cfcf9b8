"""Post-hoc analysis without a run: runs of one name are told apart by their folders (the
summaries of real runs: tests/e2e/test_analysis.py)."""
from flexmarl_hpc.analysis.load import distinct_names


def test_runs_of_one_name_are_told_apart_by_their_folders():
    assert distinct_names(["/r/a/local.h5", "/r/b/local.h5", "/r/b/other.h5"]) == ["a/local", "b/local", "other"]
    assert distinct_names(["/x/run/a/local.h5", "/y/run/a/local.h5"]) == ["x/run/a/local", "y/run/a/local"]
    assert distinct_names(["/r/a/local.h5", "/r/a/local.h5"]) == ["local", "local"]     # the same file twice
