"""The load a real run had (sim/hostload.py), the simulator run at that load
(`Efficiency.external_cores`), and the outlier rule of the calibration test."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from flexmarl_hpc.config.plan import resolve
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.workflows.build import build_task
from flexmarl_hpc.sim.cores import CoreShare, Job
from flexmarl_hpc.sim.driver import cost_model, measure, simulate_run
from flexmarl_hpc.sim.hardware import HardwareError, load_hardware, validate_hardware
from flexmarl_hpc.sim.hostload import HostLoad, LoadSampler, busy_seconds, pid_stat, reject_outliers, tree_ticks
from flexmarl_hpc.sim.calibrate_cli import calibrate, with_load
from tests.conftest import ROOT
from tests.helpers import REFERENTIAL, truth_profile

STAT = """cpu  100 20 30 1000 50 5 7 11 13 0
cpu0 50 10 15 500 25 2 3 5 6 0
intr 12345
"""


def test_busy_seconds_counts_user_nice_system_irq_softirq_and_steal_not_idle_or_iowait():
    assert busy_seconds(STAT, 100.0) == pytest.approx((100 + 20 + 30 + 5 + 7 + 11) / 100)
    with pytest.raises(ValueError, match="no aggregate 'cpu' line"):
        busy_seconds("cpu0 1 2 3 4\n", 100.0)


def test_external_load_is_the_machines_busy_time_less_the_commands_own():
    load = HostLoad()
    load.fill(busy_s=30.0, own_s=10.0, wall_s=10.0)
    assert (load.own_cores, load.external_cores) == (1.0, 2.0)
    assert load.available(2.0) == 1.0                  # what it used is a floor: it had that
    load.fill(busy_s=5.0, own_s=8.0, wall_s=10.0)      # tick rounding: never negative
    assert load.external_cores == 0.0 and load.available(2.0) == 2.0
    load.fill(busy_s=20.0, own_s=0.0, wall_s=10.0)
    assert load.available(2.0) == pytest.approx(0.05)  # a saturated machine still ran it


def test_pid_stat_and_the_process_tree():
    text = "42 (py (x) y) S 7 42 7 0 -1 4194304 1 0 0 0 30 10 5 2 20 0 1 0 99 1 1"
    assert pid_stat(text) == (7, 30 + 10, 5 + 2)
    stats = {7: (1, 100, 9), 42: (7, 40, 7), 43: (42, 3, 0), 50: (1, 1000, 0)}
    # 7's descendants and what 7 reaped, not 7's own 100 nor the unrelated 50
    assert tree_ticks(stats, 7) == 9 + 47 + 3 and tree_ticks(stats, 42) == 7 + 3 and tree_ticks(stats, 99) == 0


def test_a_child_that_burns_cpu_counts_as_the_commands_own_not_as_load():
    """A child that spins for 0.3 s of its own CPU time (however long the machine makes that
    take) and then sleeps 0.3 s: the sampler sees its CPU as this process's, whatever else runs."""
    spin = ("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
            "time.sleep(0.3)")
    with LoadSampler(period=0.05) as sampler:
        t0 = time.time()
        subprocess.run([sys.executable, "-c", spin], check=True)
        t1 = time.time()
    load = sampler.window(t0, t1)
    assert load.own_cores * load.wall_s >= 0.25
    assert load.external_cores >= 0.0 and load.wall_s == pytest.approx(t1 - t0)
    with pytest.raises(ValueError, match="window: expected"):
        sampler.window(t0 - 100, t1)


def test_reject_outliers_drops_the_run_far_from_its_repetitions_only():
    assert reject_outliers([0.0, 0.02, -0.01, 0.9]).tolist() == [True, True, True, False]
    assert reject_outliers([0.10, 0.11, 0.12]).all()          # near-equal: the floor keeps them
    assert reject_outliers([0.0, 0.001, 0.2]).tolist() == [True, True, False]   # > 3 x 5%
    assert reject_outliers([0.0, 0.001, 0.14]).all()                            # < 3 x 5%
    with pytest.raises(ValueError, match="errors: expected a non-empty"):
        reject_outliers([])


def test_external_cores_is_validated_against_shared_cores():
    hw = load_hardware("cpu_local")
    assert with_load(hw, 0.5).efficiency.rank_cores() == 1.5
    with pytest.raises(HardwareError, match="'efficiency.external_cores': expected < shared_cores"):
        with_load(hw, 2.0)
    h100 = load_hardware("h100_ndr")
    with pytest.raises(HardwareError, match="'efficiency.external_cores': expected 0 without shared_cores"):
        validate_hardware(dataclasses.replace(h100, efficiency=dataclasses.replace(h100.efficiency,
                                                                                   external_cores=1.0)))


def test_a_job_on_half_a_core_takes_twice_its_work():
    share = CoreShare(0.5, 0.0)
    share.add(Job("a", 0.0, 1.0))
    assert share.advance(10.0)[0][0] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="cores: expected > 0"):
        CoreShare(0.0, 0.0)


def _real_looking_run(tmp_path, hw, name: str):
    """A simulated sync run on `hw` with its `simulated` mark removed (a real run's schema)."""
    cfg = load_config(str(ROOT / "configs/local.yaml"), [*REFERENTIAL, "run.mode=sync", "run.steps=10",
                                                         f"run.output_dir={tmp_path / name}"])
    path, _ = simulate_run(resolve(cfg), cost_model(resolve(cfg), hw, len(build_task(cfg).vocab), 4), tmp_path / name, name)
    with h5py.File(path, "a") as f:
        del f.attrs["simulated"]
    return cfg, path


def test_a_run_fitted_at_its_load_predicts_the_unloaded_machine_and_one_fitted_blind_does_not(tmp_path):
    """The truth run shared its 2 cores with 1.2 cores of other load. Calibrated with that load,
    the profile predicts the truth's unloaded run (within 5%); calibrated as if the machine had
    been idle, it reads the load as a slower machine (off by > 20%: the check can fail)."""
    truth = truth_profile()
    cfg, loaded = _real_looking_run(tmp_path, with_load(truth, 1.2), "loaded")
    _, quiet = _real_looking_run(tmp_path, truth, "quiet")
    want = measure(quiet)["step_s"]
    assert measure(loaded)["step_s"] > 1.3 * want          # the load is visible in the run
    vocab, steps = len(build_task(cfg).vocab), {}
    for label, ext in (("aware", 1.2), ("blind", 0.0)):
        got = calibrate(str(loaded), external_cores=ext)
        assert got.efficiency.external_cores == 0.0          # the fitted profile is the unloaded machine
        # the file has no orchestrator intervals nor message gaps: those are the truth's
        got = dataclasses.replace(got, efficiency=dataclasses.replace(
            got.efficiency, orchestrator_s=4e-4, orchestrator_step_s=6e-3, message_latency_s=1e-3))
        path, _ = simulate_run(resolve(cfg), cost_model(resolve(cfg), got, vocab, 4), tmp_path / label, label)
        steps[label] = measure(path)["step_s"]
    assert steps["aware"] == pytest.approx(want, rel=0.05), (steps, want)
    assert abs(steps["blind"] / want - 1) > 0.2, (steps, want)
    assert np.isfinite(list(steps.values())).all()


def test_the_cli_refuses_a_load_of_every_core_by_name(tmp_path, capsys):
    from flexmarl_hpc.simulate import main
    truth = truth_profile()
    _, path = _real_looking_run(tmp_path, truth, "run")
    code = main(["calibrate", str(ROOT / "configs/local.yaml"), *REFERENTIAL, "--run", str(path),
                 "--external-cores", "2", "--out", str(tmp_path / "sim")])
    assert code == 2
    assert "'efficiency.external_cores': expected < shared_cores (2), got 2.0" in capsys.readouterr().err
