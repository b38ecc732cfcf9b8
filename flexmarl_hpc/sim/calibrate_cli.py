"""`simulate calibrate`: a profile fitted to a real run (sim/calibrate.py), the variants
predicted on it, and with --measured the prediction's error.

    python -m flexmarl_hpc.simulate calibrate configs/skewed.yaml --run runs/skewed/skewed.h5 --workers real
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.sim.cli_options import common_options, variants_option, workers_option
from flexmarl_hpc.sim.driver import measure, simulate_run
from flexmarl_hpc.sim.hardware import HardwareError, HardwareProfile, load_hardware, validate_hardware
from flexmarl_hpc.sim.runs import local_cost, run_config, variant_config, variant_list, variant_of


def calibrate(h5: str, base: str = "cpu_local", external_cores: float = 0.0) -> HardwareProfile:
    """The `base` profile fitted to the real run `h5` (sim.calibrate; its own config gives the
    model shape, max_batch and replicas). `external_cores`: the load other processes put on
    the machine during that run (sim.hostload): its intervals are read as work on the cores
    left, so the fitted profile is the unloaded machine's (its external_cores 0)."""
    from flexmarl_hpc.sim.calibrate import fit, observe
    if not Path(h5).is_file():
        raise ValueError(f"--calibrate: no such file {h5}")
    plan, hw = run_config(h5), load_hardware(base)
    cfg, loaded = plan.cfg, with_load(hw, external_cores)
    shape = local_cost(plan, hw).layout(cfg.agent_names[0]).model
    obs = observe(h5, max(cfg.rollout.max_batch, 1), cfg.rollout.replicas,
                  shared_cores=loaded.efficiency.rank_cores(), waiting_share=hw.efficiency.waiting_share,
                  workers_poll=cfg.run.idle_wait == "poll")
    return fit(obs, hw, shape, h5)


def with_load(hw: HardwareProfile, external_cores: float) -> HardwareProfile:
    """`hw` on a machine where other processes keep `external_cores` busy (validated: less
    than its shared_cores)."""
    eff = dataclasses.replace(hw.efficiency, external_cores=float(external_cores))
    return validate_hardware(dataclasses.replace(hw, efficiency=eff),
                             f"{hw.name} with external_cores {external_cores}")


def predict_variants(config: str, variants: list[str], hw: HardwareProfile, steps: int, out: Path,
                     overrides: list[str] = (), workers: str = "synthetic") -> dict[str, dict]:
    """Small CPU configs on a (fitted) profile, models priced with the task's vocabulary in
    fp32; step_s as bench_modes measures it. Synthetic workers answer with the turn's whole
    budget of tokens; real ones (in-process) with what the policy generates, so a workload
    whose lengths come from the policy (configs/skewed.yaml) is priced as it runs."""
    results = {}
    for v in variants:
        plan, _ = variant_config(config, v, steps, out, overrides, hw)
        path, _ = simulate_run(plan, local_cost(plan, hw), out / v, hw.name, workers=workers)
        results[v] = measure(path)
    return results


def calibrate_main(a: argparse.Namespace, out: Path) -> int:
    """`simulate calibrate`: fit, print the figures, predict the variants (and compare)."""
    import numpy as np
    from flexmarl_hpc.sim.hardware import save_hardware
    try:
        hw = calibrate(a.run, a.hardware, a.external_cores)
        pred = predict_variants(a.config, variant_list(a.variants), with_load(hw, a.external_cores), a.steps, out,
                                a.overrides, a.workers)
        measured: dict[str, list[float]] = {}
        for h5 in a.measured:
            measured.setdefault(variant_of(run_config(h5).cfg), []).append(measure(Path(h5))["step_s"])
    except (ConfigError, HardwareError, ValueError, OSError) as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    print(f"fitted from {a.run}: {fitted_summary(hw)}")
    if a.write_profile is not None:
        save_hardware(hw, a.write_profile, f"fitted by simulate --calibrate {a.run}\n"
                      f"from the base profile {a.hardware}")
    res = {}
    for v, r in pred.items():
        m = measured.get(v)
        res[v] = {"predicted_step_s": r["step_s"]}
        if m:
            res[v].update(measured_step_s=float(np.median(m)), measured_runs=len(m),
                          error=r["step_s"] / float(np.median(m)) - 1)
    if "sync" in res and len(res) > 1:
        for v, r in res.items():
            r["predicted_vs_sync"] = res["sync"]["predicted_step_s"] / r["predicted_step_s"]
            if "measured_step_s" in r and "measured_step_s" in res["sync"]:
                r["measured_vs_sync"] = res["sync"]["measured_step_s"] / r["measured_step_s"]
                r["ratio_error"] = r["predicted_vs_sync"] / r["measured_vs_sync"] - 1
    if a.json:
        print(json.dumps({"profile": dataclasses.asdict(hw), "variants": res}, indent=1))
        return 0
    print(f"{'variant':12s} {'predicted s':>11s} {'measured s':>10s} {'error':>7s} "
          f"{'pred vs sync':>12s} {'meas vs sync':>12s} {'error':>7s}")
    for v, r in res.items():
        meas = f"{r['measured_step_s']:10.3f} {r['error']:+7.1%}" if "measured_step_s" in r else f"{'-':>10s} {'-':>7s}"
        ratio = (f"{r['predicted_vs_sync']:11.2f}x" if "predicted_vs_sync" in r else f"{'-':>12s}")
        mr = (f"{r['measured_vs_sync']:11.2f}x {r['ratio_error']:+7.1%}" if "ratio_error" in r
              else f"{'-':>12s} {'-':>7s}")
        print(f"{v:12s} {r['predicted_step_s']:11.3f} {meas} {ratio} {mr}")
    return 0


def fitted_summary(hw: HardwareProfile) -> str:
    """One line of a fitted profile's figures; a term the fit found negligible (at the end
    of its search range: the run's intervals show no such cost) says so instead of a number."""
    from flexmarl_hpc.sim.calibrate import B_GRID, F_RANGE
    e = hw.efficiency
    gen = hw.peak_flops * e.mfu_prefill
    flops = ("FLOPs negligible" if gen >= 0.99 * F_RANGE[1] else f"FLOPs at {gen / 1e9:.3g} GFLOP/s")
    memory = ("memory reads negligible" if hw.hbm_bandwidth >= 0.99 * B_GRID[-1]
              else f"memory {hw.hbm_gb_s:.3g} GB/s")
    return (f"generate = {e.call_overhead_s * 1e3:.2f} ms/call + {e.decode_step_overhead_s * 1e3:.2f} ms/decode "
            f"step, {flops}, {memory}; train FLOPs at {hw.peak_flops * e.mfu_train / 1e9:.3g} GFLOP/s + "
            f"{e.optimizer_overhead_s * 1e3:.2f} ms/optimizer step; sync latency {e.bucket_latency_s * 1e3:.2f} ms; "
            f"orchestrator {e.orchestrator_s * 1e3:.2f} ms/reply + {e.orchestrator_step_s * 1e3:.2f} ms/agent step; "
            f"message latency {e.message_latency_s * 1e3:.2f} ms")


def check_calibrate(a: argparse.Namespace) -> str | None:
    if not Path(a.run).is_file():
        return f"--run: no such file {a.run}"
    return None


def calibrate_options(p: argparse.ArgumentParser) -> None:
    common_options(p, "cpu_local", 10)
    p.add_argument("--run", required=True, metavar="RUN.h5", help="the real run to fit --hardware to")
    variants_option(p)
    p.add_argument("--measured", nargs="*", default=[], metavar="H5",
                   help="real runs of the variants, to print predicted vs measured")
    p.add_argument("--write-profile", type=Path, default=None, help="write the fitted profile here")
    p.add_argument("--external-cores", type=float, default=0.0, metavar="X",
                   help="cores other processes kept busy during --run (and the --measured runs): the fit "
                        "reads the run on the cores left, the predictions run at that load (sim/hostload.py)")
    workers_option(p)

