"""Unit tests of the calibration fit (sim/calibrate.py): observations generated from known
parameters by the cost model itself must give those parameters back; a simulated run of a
known profile, read back through observe(), must give a profile that predicts its step time."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flexmarl_hpc.config.plan import resolve
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.workflows.build import build_task
from flexmarl_hpc.sim.calibrate import Observations, fit, fit_columns, observe
from flexmarl_hpc.sim.costs import CostModel, optimizer_s
from flexmarl_hpc.sim.driver import cost_model, measure, simulate_run
from flexmarl_hpc.sim.hardware import load_hardware
from tests.conftest import ROOT
from tests.helpers import REFERENTIAL, truth_profile


def synthetic_observations(hw, layout, rng) -> Observations:
    """Generate and train intervals of varied shapes priced by CostModel on `hw`."""
    cost = CostModel(hw, {"a": layout})
    gen, batches = [], []
    for _ in range(60):
        n, prompt = int(rng.integers(1, 40)), int(rng.integers(1, 8))
        lens = rng.integers(1, 12, size=n)
        gen.append(cost.generate_s("a", n, [prompt] * n, lens))
        batches.append((n * prompt, float(prompt), lens))
    tr_tokens = rng.integers(20, 400, size=40).astype(float)
    last = (rng.random(40) < 0.3).astype(float)
    train = [cost.train_s("a", int(t), bool(o)) for t, o in zip(tr_tokens, last)]
    sync = np.full(10, cost.sync_s("a", cost.weight_bytes("a")))
    return Observations(np.array(gen), batches, layout.max_num_seqs, np.array(train),
                        tr_tokens, last, sync, orchestrator_busy_s=0.4, replies=1000,
                        orchestrator_log_s=0.6, agent_steps=100, gaps_s=np.full(50, 1e-3))


def small_layout():
    cfg = load_config(str(ROOT / "configs/local.yaml"), REFERENTIAL)
    hw = truth_profile()
    return cost_model(resolve(cfg), hw, len(build_task(cfg).vocab), 4).layout("speaker")


def test_the_fit_recovers_the_parameters_that_generated_the_intervals():
    hw, layout = truth_profile(), small_layout()
    obs = synthetic_observations(hw, layout, np.random.default_rng(0))
    got = fit(obs, load_hardware("cpu_local"), layout.model, "synthetic.h5")
    e, t = got.efficiency, hw.efficiency
    rel = lambda a, b: abs(a / b - 1)                      # noqa: E731
    assert rel(got.peak_flops * e.mfu_prefill, hw.peak_flops * t.mfu_prefill) < 0.02
    assert rel(got.peak_flops * e.mfu_train, hw.peak_flops * t.mfu_train) < 0.02
    assert rel(e.call_overhead_s, t.call_overhead_s) < 0.02
    assert rel(e.decode_step_overhead_s, t.decode_step_overhead_s) < 0.02
    # the truth's memory term vanishes (not identified): the optimizer's seconds are what count
    assert rel(optimizer_s(got, layout), optimizer_s(hw, layout)) < 0.05
    assert rel(e.bucket_latency_s, t.bucket_latency_s) < 0.05
    assert rel(e.orchestrator_s, t.orchestrator_s) < 1e-9 and rel(e.orchestrator_step_s, t.orchestrator_step_s) < 1e-9
    assert rel(e.message_latency_s, t.message_latency_s) < 1e-9
    assert "fitted by simulate --calibrate synthetic.h5" in got.accelerator and got.name == "cpu_local_fitted"


def test_a_memory_bound_decode_is_fitted_with_its_bandwidth_and_predicts_every_interval():
    """A truth whose decode steps are bound by KV reads: the fitted bandwidth is the truth's,
    and the fitted profile prices each generate interval as the truth did. (Taking the memory
    bandwidth from the optimizer instead, as the fit once did, priced a CPU run's decode steps
    at twice their measured time.)"""
    hw, layout = truth_profile(), small_layout()
    hw = dataclasses.replace(hw, hbm_gb_s=0.02)                # 20 MB/s: KV reads dominate
    obs = synthetic_observations(hw, layout, np.random.default_rng(1))
    got = fit(obs, load_hardware("cpu_local"), layout.model, "synthetic.h5")
    assert abs(got.hbm_gb_s * got.efficiency.hbm / 0.02 - 1) < 0.05
    again = synthetic_observations(got, layout, np.random.default_rng(1))
    np.testing.assert_allclose(again.gen_s, obs.gen_s, rtol=0.02)


def test_a_term_the_run_cannot_separate_keeps_the_prior_instead_of_absorbing_noise():
    x = np.arange(1.0, 11.0)
    cols = [np.ones(10), x, 3 * np.ones(10)]               # the third is the first again
    y = 2.0 + 0.5 * x + 3 * 7.0
    got = fit_columns(cols, y, prior=[0.0, 0.0, 7.0])
    assert got == pytest.approx([2.0, 0.5, 7.0])


def test_calibrating_on_a_simulated_run_predicts_its_step_time_and_the_placeholder_does_not(tmp_path):
    """observe() + fit() close the loop: a run of the truth profile, read back, gives a profile
    whose prediction matches it; the uncalibrated placeholder misses by far (the check can fail)."""
    cfg = load_config(str(ROOT / "configs/local.yaml"), [*REFERENTIAL, "run.mode=sync", "run.steps=12",
                                                         f"run.output_dir={tmp_path / 'truth'}"])
    vocab = len(build_task(cfg).vocab)
    truth, _ = simulate_run(resolve(cfg), cost_model(resolve(cfg), truth_profile(), vocab, 4), tmp_path / "truth", "truth")
    base = load_hardware("cpu_local")
    assert base.efficiency.shared_cores == 2 and base.efficiency.waiting_share > 0
    # the truth ran on 2 shared cores with waiting ranks: observe() reads each interval's
    # work at a whole core (plain durations would fit a slower machine, see test_sim_cores)
    obs = observe(truth, 32, 2, allow_simulated=True, shared_cores=2,
                  waiting_share=base.efficiency.waiting_share, workers_poll=cfg.run.idle_wait == "poll")
    assert len(obs.gen_s) == 12 * 5 and len(obs.train_s) == 12 * 5 and obs.train_last.sum() == 24
    # the simulated file has no orchestrator intervals nor message gaps: take those as known
    got = fit(obs, dataclasses.replace(base, efficiency=dataclasses.replace(
        base.efficiency, message_latency_s=1e-3)), cost_model(resolve(cfg), base, vocab, 4).layout("speaker").model, "t")
    got = dataclasses.replace(got, efficiency=dataclasses.replace(
        got.efficiency, orchestrator_s=4e-4, orchestrator_step_s=6e-3))
    pred, _ = simulate_run(resolve(cfg), cost_model(resolve(cfg), got, vocab, 4), tmp_path / "pred", "fitted")
    placeholder, _ = simulate_run(resolve(cfg), cost_model(resolve(cfg), base, vocab, 4), tmp_path / "ph", "cpu_local")
    want = measure(truth)["step_s"]
    assert measure(pred)["step_s"] == pytest.approx(want, rel=0.02)
    assert abs(measure(placeholder)["step_s"] / want - 1) > 0.2


def test_observe_refuses_a_simulated_file_and_a_file_that_is_not_a_run(tmp_path):
    import h5py
    cfg = load_config(str(ROOT / "configs/local.yaml"), [*REFERENTIAL, "run.mode=sync", "run.steps=3",
                                                         f"run.output_dir={tmp_path}"])
    path, _ = simulate_run(resolve(cfg), cost_model(resolve(cfg), truth_profile(), len(build_task(cfg).vocab), 4), tmp_path, "t")
    with pytest.raises(ValueError, match="simulated run; calibrate from a real"):
        observe(path, 32, 2)
    with h5py.File(tmp_path / "empty.h5", "w"):
        pass
    with pytest.raises(ValueError, match="empty.h5: not a run file"):
        observe(tmp_path / "empty.h5", 32, 2)


def test_the_cli_fits_prints_predicts_compares_and_writes_a_loadable_profile(tmp_path, capsys):
    """`simulate CONFIG --calibrate RUN.h5 --measured ... --write-profile P` on a run file of
    the real schema (a simulated run with its `simulated` mark removed stands in for it)."""
    import h5py
    from flexmarl_hpc.simulate import main
    runs = {}
    for mode in ("sync", "flex"):
        cfg = load_config(str(ROOT / "configs/local.yaml"), [*REFERENTIAL, f"run.mode={mode}", "run.steps=8",
                                                             f"run.output_dir={tmp_path / mode}"])
        runs[mode], _ = simulate_run(resolve(cfg), cost_model(resolve(cfg), truth_profile(), len(build_task(cfg).vocab), 4),
                                     tmp_path / mode, "t")
        with h5py.File(runs[mode], "a") as f:
            del f.attrs["simulated"]
    prof = tmp_path / "fitted.yaml"
    code = main(["calibrate", str(ROOT / "configs/local.yaml"), *REFERENTIAL, "--run", str(runs["sync"]), "--steps", "8",
                 "--measured", str(runs["sync"]), str(runs["flex"]), "--write-profile", str(prof),
                 "--out", str(tmp_path / "sim")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"fitted from {runs['sync']}: generate = " in out and "GFLOP/s" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["sync"], ["flex"])}
    assert set(rows) == {"sync", "flex"} and all(r[2] != "-" for r in rows.values())   # measured given
    fitted = load_hardware(prof)
    assert fitted.name == "cpu_local_fitted" and fitted.efficiency.call_overhead_s > 0
    assert prof.read_text().startswith(f"# fitted by simulate --calibrate {runs['sync']}")
