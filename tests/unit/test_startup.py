"""Start-up's budget (runtime/startup.py, run.build_timeout_s / run.comm_setup_timeout_s):
the fields' bounds, the train.log line, and a phase past its deadline on one rank."""
from __future__ import annotations

import time

import pytest

from tests.conftest import ROOT

LOCAL = str(ROOT / "configs" / "local.yaml")


@pytest.mark.parametrize("field", ["run.build_timeout_s", "run.comm_setup_timeout_s"])
@pytest.mark.parametrize("value", ["0", "-5", "86401", "nan"])
def test_each_startup_deadline_is_bounded_and_refused_by_name(field, value):
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.config.schema import ConfigError
    with pytest.raises(ConfigError, match=f"^{field}: expected (0 < x <= 86400|a finite number)"):
        load_config(LOCAL, [f"{field}={value}"])
    assert getattr(load_config(LOCAL, [f"{field}=86400"]).run, field.split(".")[1]) == 86400.0


def test_the_log_line_names_the_slowest_rank_and_the_median_of_the_busy_ones():
    from flexmarl_hpc.runtime.startup import report
    line = report("build", [0.0, 12.0, 250.5, 30.0], lambda r: f"replica {r - 1}")
    assert line == ("start-up: engines and trainers built in 250.5 s (slowest: replica 1, rank 2; median 30.0 s "
                    "over 3 ranks; run.build_timeout_s bounds it)")
    assert report("comm", [0.0, 0.0], str).startswith("start-up: weight-sync communicators set up in 0.0 s")


class _World:
    """One rank of a world whose other ranks never arrive: the gather never completes."""

    def Get_size(self):
        return 2

    def Iallgather(self, send, got):
        return type("R", (), {"Test": lambda self: False})()


def test_a_phase_past_its_deadline_raises_naming_the_field():
    from flexmarl_hpc.runtime.startup import StartupTimeout, started
    t0 = time.monotonic()
    with pytest.raises(StartupTimeout, match=r"weight-sync communicators set up .*\(run.comm_setup_timeout_s=0.2; "
                                             r"this rank's own part: 1.5 s\)"):
        started(_World(), None, "comm", 1.5, 0.2, t0)
    assert time.monotonic() - t0 < 5
