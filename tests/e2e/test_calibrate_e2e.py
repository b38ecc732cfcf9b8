"""End-to-end fidelity check (issue 11 item 3, issue 26): the CPU profile is calibrated on one
workload's real sync run and predicts the other workload, sync and flex, out of sample, on a
machine whose load it measures.

    PYTHONPATH=. nice -n 15 .venv/bin/python -m pytest tests/e2e/test_calibrate_e2e.py -s -q

Workload A, the calibration: bench_modes' referential game (2 agents, 2 turns, 2 replicas, 5
ranks, 8 inputs x 4 samples). Workload B, the validation: configs/relay3.yaml (3 agents in a
chain of 3 turns, 3 trainer groups, 6 ranks, 8 x 4 then 2 samples, 256-row batches). Nothing of
B enters the fit. (configs/skewed.yaml, whose lengths come from the policy, needs the real
engine in the simulator: on the loaded machine its prediction alone ran past 10 minutes.)

Why it survives a loaded machine (it failed twice at load 6-12 when it fitted one run and
compared with the median of others: the load of the fitted run and of the measured ones
differed):
- every run is measured with its load over its timed steps (sim.hostload.LoadSampler: the
  machine's busy CPU time minus the run's own, per wall second, sampled every 0.2 s; a short
  run's wall time is mostly start-up, whose load says little about the steps'), its step
  time the mean over that window, and it is predicted at that load (`Efficiency.external_cores`: the
  simulated ranks share the cores left); the fit reads the calibration run on the cores it had,
  so the fitted profile is the unloaded machine's;
- the calibration run is the A run of least external load (the correction matters least);
- each B run is REPS times repeated (runs interleaved A, B-sync, B-flex, rotated), each run's
  log error against its own prediction computed, and a run whose error is more than 3 scaled
  median absolute deviations (at least 5%) from its repetitions' median rejected as an
  outlier (`reject_outliers`): the model's error is common to the repetitions, a run that
  disagrees with them disagrees by load the mean did not capture. The error asserted is the
  median of the kept runs'.
Asserted: B's step time per mode within TOL_STEP and the flex/sync ratio within TOL_RATIO.
Measured (docs/LOG.md, 2026-11-26): at load average 7.5-10.7 errors +3.7% / -0.9% / ratio
+4.6%, the runs' steps 0.056-0.541 s; at 8.2-9.6 -12.8% / -10.1% / -3.0%; with 2 more busy
processes at nice 0 for the first 150 s, -7.4% / -13.1% / +6.6%, the starved B sync run (log
error -0.81) rejected. 2-4.5 min on the loaded machine, ~10 with the extra load.
"""
from __future__ import annotations

import h5py
import numpy as np

from flexmarl_hpc.sim.driver import measure
from flexmarl_hpc.sim.hardware import load_hardware
from flexmarl_hpc.sim.hostload import LoadSampler, reject_outliers
from flexmarl_hpc.sim.calibrate_cli import calibrate, predict_variants, with_load
from tests.conftest import ROOT, run_training

COMMON = ["run.log_every=1000", "run.checkpoint_every=0", "run.checkpoint_minutes=0", "run.resume=false"]
A = (str(ROOT / "configs/local.yaml"), 12, ["rollout.replicas=2", "rollout.max_batch=32",
                                            "workflow.task_args.num_objects=8", "workflow.inputs_per_step=8",
                                            "run.eval_every=0"], "synthetic")
"""(config, steps, overrides, simulated workers): bench/bench_modes.py's referential workload."""
B = (str(ROOT / "configs/relay3.yaml"), 12, ["run.eval_every=0"], "synthetic")
"""The three-agent relay (a chain of 3 turns, 3 trainer groups, 6 ranks): its messages have
fixed lengths, so synthetic workers price what the real ones generate."""
REPS = 3
TOL_STEP, TOL_RATIO = 0.25, 0.20
"""Asserted relative errors on B (out of sample): step time per mode, flex/sync ratio."""
SKIP = 2
"""Start-up steps left out of the timed window (driver.measure's skip)."""
LOAD_BIN = 0.1
"""Runs whose external load rounds to the same LOAD_BIN cores share one simulation."""


def steps_window(path) -> tuple[float, float, float]:
    """(first, last, mean step s): the epoch seconds of the timed steps (after the first 2, as
    driver.measure skips them) and their mean gap, which the window's mean load goes with."""
    with h5py.File(path, "r") as f:
        t = f["metrics"]["t"][:] + float(f.attrs["t0"])
    t = t[SKIP - 1:]
    return float(t[0]), float(t[-1]), float((t[-1] - t[0]) / (len(t) - 1))


def real_run(tmp_path, name: str, workload, mode: str) -> dict:
    config, steps, overrides, _ = workload
    out = tmp_path / name
    with LoadSampler() as sampler:
        run_training(out, *overrides, *COMMON, f"run.steps={steps}", f"run.mode={mode}", config=config, timeout=900)
    path = next(out.glob("*.h5"))
    t0, t1, step_s = steps_window(path)
    return {"name": name, "mode": mode, "path": path, "load": sampler.window(t0, t1), "step_s": step_s,
            "median_step_s": measure(path)["step_s"]}


def external(hw, load) -> float:
    """The run's load as the simulator takes it: the cores it did not have."""
    return hw.efficiency.shared_cores - load.available(hw.efficiency.shared_cores)


def predict(fitted, workload, mode: str, ext: float, out, cache: dict) -> float:
    key = (mode, round(ext / LOAD_BIN))
    if key not in cache:
        config, steps, overrides, workers = workload
        hw = with_load(fitted, key[1] * LOAD_BIN)
        cache[key] = predict_variants(config, [mode], hw, steps, out / f"{mode}{key[1]}", overrides,
                                      workers)[mode]["step_s"]
    return cache[key]


def summarise(runs: list[dict]) -> tuple[float, np.ndarray]:
    """The relative error (predicted / measured - 1) of the kept runs' median log error, and
    the mask of those kept."""
    e = np.log([r["pred"] / r["step_s"] for r in runs])
    keep = reject_outliers(e)
    return float(np.exp(np.median(e[keep])) - 1), keep


def test_calibrated_on_one_workload_the_simulator_predicts_the_other_under_load(tmp_path, mpiexec):
    runs = []
    order = [("A", "sync"), ("B", "sync"), ("B", "flex")]
    for rep in range(REPS):
        for w, mode in order[rep % 3:] + order[:rep % 3]:
            runs.append({**real_run(tmp_path, f"{w}{mode}{rep}", A if w == "A" else B, mode), "w": w})
    hw = load_hardware("cpu_local")
    calib = min((r for r in runs if r["w"] == "A"), key=lambda r: r["load"].external_cores)
    fitted = calibrate(str(calib["path"]), external_cores=external(hw, calib["load"]))
    cache: dict = {}
    for r in runs:
        if r["w"] == "B":
            r["pred"] = predict(fitted, B, r["mode"], external(hw, r["load"]), tmp_path / "sim", cache)
    err, kept = {}, {}
    for mode in ("sync", "flex"):
        err[mode], kept[mode] = summarise([r for r in runs if r["w"] == "B" and r["mode"] == mode])
    ratio_err = (1 + err["sync"]) / (1 + err["flex"]) - 1      # predicted sync/flex over measured
    for r in runs:
        ld = r["load"]
        print(f"{r['name']:>7}: step {r['step_s']:.3f} s, predicted {r.get('pred', float('nan')):.3f} s; "
              f"(median {r['median_step_s']:.3f}); steps' window {ld.wall_s:.1f} s: external "
              f"{ld.external_cores:.2f} cores, own {ld.own_cores:.2f}, load avg {ld.loadavg:.1f}")
    print(f"calibrated on {calib['name']}; B errors, predicted / measured - 1 (median of kept runs): "
          f"sync {err['sync']:+.1%} flex {err['flex']:+.1%}, flex/sync ratio {ratio_err:+.1%}; kept {kept}")
    assert abs(err["sync"]) < TOL_STEP, err
    assert abs(err["flex"]) < TOL_STEP, err
    assert abs(ratio_err) < TOL_RATIO, ratio_err
