"""Post-hoc analysis without a run: runs of one name are told apart by their folders (the
summaries of real runs: tests/e2e/test_analysis.py)."""
from flexmarl_hpc.analysis.load import distinct_names


def test_runs_of_one_name_are_told_apart_by_their_folders():
    assert distinct_names(["/r/a/local.h5", "/r/b/local.h5", "/r/b/other.h5"]) == ["a/local", "b/local", "other"]
    assert distinct_names(["/x/run/a/local.h5", "/y/run/a/local.h5"]) == ["x/run/a/local", "y/run/a/local"]
    assert distinct_names(["/r/a/local.h5", "/r/a/local.h5"]) == ["local", "local"]     # the same file twice


def test_steps_configured_is_the_latest_launchs_when_its_config_is_beside_the_file(tmp_path):
    """A run of 20 steps resumed with run.steps=44: the file keeps the first launch's config,
    the folder's config.yaml (rewritten at every launch) says 44; another run's does not count."""
    import pandas as pd
    import yaml
    from flexmarl_hpc.analysis.load import Run, steps_configured
    empty = pd.DataFrame()
    run = Run(tmp_path / "r.h5", {}, {"run": {"name": "r", "steps": 20}}, empty, empty, empty, empty, empty)
    assert steps_configured(run) == 20                                  # nothing beside it
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"run": {"name": "r", "steps": 44}}))
    assert steps_configured(run) == 44
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"run": {"name": "other", "steps": 44}}))
    assert steps_configured(run) == 20
    (tmp_path / "config.yaml").write_text("run: [unclosed")
    assert steps_configured(run) == 20
