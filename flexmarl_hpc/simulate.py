"""Simulate a config at cluster scale: the real orchestrator on a discrete-event clock.

    python -m flexmarl_hpc.simulate compare configs/paper_3x32b_7x14b.yaml --variants sync,flex
    python -m flexmarl_hpc.simulate compare configs/paper_5x32b.yaml --hardware h100_ndr --steps 10 --json
    python -m flexmarl_hpc.simulate plan configs/paper_3x32b_7x14b.yaml --nodes 48 --top 3 --write plan48.yaml
    python -m flexmarl_hpc.simulate scale configs/paper_3x32b_7x14b.yaml --counts 1,2,4,768 --png scale.png
    python -m flexmarl_hpc.simulate calibrate configs/skewed.yaml --run runs/skewed/skewed.h5 --workers real
    python -m flexmarl_hpc.simulate capacity configs/local.yaml        # the orchestrator's own limit
    python -m flexmarl_hpc.simulate memory configs/paper_3x32b_7x14b.yaml   # peak memory per rank (fake tensors)

Each subcommand takes CONFIG, key=value overrides, --hardware, --steps, --json and --out;
`python -m flexmarl_hpc.simulate SUBCOMMAND --help` lists the rest. The flag forms before
subcommands (`simulate CONFIG --compare ...`, `--plan`, `--scale`, `--calibrate`,
`--capacity`) still run, with a one-line notice naming the subcommand's command line.

compare: each variant (--variants) runs the real Orchestrator, Scheduler, Experience,
workflow and rewards over sim.transport.SimTransport. Its workers (--workers) are synthetic
(responses of modelled length, training skipped: any model size) or real (the real engine
and trainers in this process, for small models: the run trains what an MPI run of the config
trains, and only the clock is modelled, from the lengths the policy really generates).
Both are priced by sim.costs (see sim/driver.py for what is modelled and README "Scale"). Each writes
`<out>/<variant>/<run>.h5` (the run schema, attrs simulated=True and hardware), which
`python -m flexmarl_hpc.analyze` reads unchanged. Printed per variant: step_s (median gap
between global steps after the first 2), accelerator utilization, samples/s and the ratio of
sync's step time to the variant's.

plan --nodes N ranks splits of N nodes among the config's rollout pools and trainer groups
(one pool per agent class = agents of one model shape; replicas, group sizes, group counts)
with the closed-form planner (sim/plan.py), simulates the best --top of distinct shapes in
flex mode, prints both estimates, and prints (and with --write, writes) the best simulated
plan's rollout.pools / trainer.named_groups with their slurm: components, ready to paste.

calibrate --run RUN.h5 fits --hardware (default cpu_local) to a real run's intervals
(sim/calibrate.py), prints the fitted figures, simulates --variants on the fitted profile with
the task's own response lengths, and with --measured H5... prints predicted vs measured
step_s per variant and the flex/sync ratio error; --write-profile saves the fitted profile.

scale --counts 1,2,4,...,3072 [--png PATH] asks the same closed-form planner, per accelerator
count (whole nodes of the profile; below one node, one node with only that many devices) and
per variant mode, for the best split, simulates it for each variant (default 4 steps), prints
step_s and utilization per count and variant (sizes that cannot hold the models: "does not
fit") and draws both against the count (sim/scale.py).

capacity runs flex with zero-cost workers and the orchestrator's real compute charged to
the clock: samples/s is then what the single orchestrator rank can drive on this CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import yaml

from flexmarl_hpc.store.checkpoint import replace_file
from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.config.load import apply_override, load_config
from flexmarl_hpc.config.resources import components
from flexmarl_hpc.sim.driver import (WORKERS, Workload, cost_model, measure, rank_devices, replica_ranks,
                                     simulate_run, sync_per_generate)
from flexmarl_hpc.sim.hardware import HardwareError, HardwareProfile, load_hardware, validate_hardware
from flexmarl_hpc.sim.plan import rank_plans
from flexmarl_hpc.sim.plan_config import (config_classes, describe_alloc, describe_classes, distinct, fragment,
                              fragment_nodes, fragment_yaml, merge_fragment, min_nodes, plan_nodes,
                              plan_workload)
from flexmarl_hpc.sim.scale import bottleneck_table, parse_sizes, plot_scale, scale_points
from flexmarl_hpc.sim.baselines import FRAGMENTS, SYNC_NO_LB, colocated_run, system_config
from flexmarl_hpc.sim.perturb import Failure, Perturbation, checkpoint_load_s, with_failure
from flexmarl_hpc.sim.paper_cli import check_paper, paper_main, paper_options
from flexmarl_hpc.sim.transport import ConstantCost

VARIANTS = {
    "sync": ["run.mode=sync"],
    "flex-nopipe": ["run.mode=flex", "pipeline.micro_batch_overlap=false"],
    "flex-nolb": ["run.mode=flex", "pipeline.load_balance=false"],
    "flex": ["run.mode=flex"],
    "flex-stale1": ["run.mode=flex", "pipeline.max_staleness=1"],
    "verl": SYNC_NO_LB,          # baselines (sim/baselines.py, docs/baselines.md)
    "marti": ["run.mode=sync"],  # + their own allocation (sim.baselines.FRAGMENTS)
    "mas-rl": ["run.mode=sync"],
}
"""Variant -> config overrides (as bench/bench_modes.py expresses the ablations)."""


def variant_config(config: str, variant: str, steps: int, out: Path, overrides: list[str] = (),
                   hw: HardwareProfile | None = None):
    """(config, colocated (pool, group) pairs) of one --compare variant, writing under
    `out`/<variant>, no checkpoints; a baseline with its own allocation (marti, mas-rl) gets
    it on the config's nodes of `hw` (sim/baselines.py)."""
    common = [*overrides, *VARIANTS[variant], f"run.steps={steps}", "run.resume=false",
              f"run.output_dir={out / variant}", "run.checkpoint_every=0", "run.checkpoint_minutes=0"]
    if variant not in FRAGMENTS:
        return load_config(config, common), []
    raw = yaml.safe_load(Path(config).read_text())
    return system_config(raw, variant, hw or load_hardware("npu64_a3"), common, out / variant / "config")


def priced(cfg, hw: HardwareProfile, workers: str):
    """The cost model and modelled workload of a run: synthetic workers price the config's
    model shape with Qwen's vocabulary and modelled lengths (bf16); real ones the models as
    they run here (the task's vocabulary, fp32) and the lengths they produce. An episode
    workflow states its own lengths (each call's max_tokens, which a synthetic reply fills:
    workflows/paper_text.py draws them from the paper's distributions): those are priced."""
    if workers == "synthetic":
        return cost_model(cfg, hw), (None if cfg.workflow.episode else Workload())
    return local_cost(cfg, hw), None


def local_cost(cfg, hw: HardwareProfile):
    """`cfg`'s models priced as they run on this machine: the task's vocabulary, fp32."""
    from flexmarl_hpc.runtime.build import build_task
    return cost_model(cfg, hw, len(build_task(cfg).vocab), 4)


def run_variants(config: str, variants: list[str], hardware: str | HardwareProfile, steps: int, out: Path,
                 overrides: list[str] = (), workers: str = "synthetic",
                 perturb: Perturbation | None = None) -> dict[str, dict]:
    hw = hardware if isinstance(hardware, HardwareProfile) else load_hardware(hardware)
    results = {}
    for v in variants:
        cfg, pairs = variant_config(config, v, steps, out, overrides, hw)
        wall = time.perf_counter()
        try:
            cost, work = priced(cfg, hw, workers)
            wrap, devices = colocated_run(cfg, cost, hw, pairs)
            path, sim = simulate_run(cfg, cost, out / v, hw.name, work, workers=workers, wrap=wrap, colocate=pairs,
                                     perturb=perturb)
        except RuntimeError as e:      # e.g. the orchestrator waits with nothing in flight
            results[v] = {"error": str(e), "wall_s": time.perf_counter() - wall}
            continue
        r = measure(path, rank_devices(cfg), devices=devices)
        r.update(wall_s=time.perf_counter() - wall, sim_s=sim.now - sim_t0(path), h5=str(path),
                 orchestrator_share=sim.orchestrator_charged / max(sim.now - sim_t0(path), 1e-12),
                 sync_per_generate=sync_per_generate(path, replica_ranks(cfg)))
        results[v] = r
    if "step_s" in results.get("sync", {}):
        for r in results.values():
            if "step_s" in r:
                r["speedup_vs_sync"] = results["sync"]["step_s"] / r["step_s"]
    return results


def run_config(path: str | Path):
    """The Config a run's HDF5 file was made with (its config_yaml attribute)."""
    import h5py
    with h5py.File(path, "r") as f:
        text = f.attrs["config_yaml"]
    raw = yaml.safe_load(text if isinstance(text, str) else text.decode())
    # a file written before run.idle_wait existed: its ranks polled (the default is doorbell)
    raw.setdefault("run", {}).setdefault("idle_wait", "poll")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as tmp:
        tmp.write(yaml.safe_dump(raw, sort_keys=False))
        tmp.flush()
        return load_config(tmp.name)


def calibrate(h5: str, base: str = "cpu_local", external_cores: float = 0.0) -> HardwareProfile:
    """The `base` profile fitted to the real run `h5` (sim.calibrate; its own config gives the
    model shape, max_batch and replicas). `external_cores`: the load other processes put on
    the machine during that run (sim.hostload): its intervals are read as work on the cores
    left, so the fitted profile is the unloaded machine's (its external_cores 0)."""
    from flexmarl_hpc.sim.calibrate import fit, observe
    if not Path(h5).is_file():
        raise ValueError(f"--calibrate: no such file {h5}")
    cfg, hw = run_config(h5), load_hardware(base)
    loaded = with_load(hw, external_cores)
    shape = local_cost(cfg, hw).layout(cfg.agent_names[0]).model
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
        cfg, _ = variant_config(config, v, steps, out, overrides, hw)
        path, _ = simulate_run(cfg, local_cost(cfg, hw), out / v, hw.name, workers=workers)
        results[v] = measure(path)
    return results


def variant_of(cfg) -> str:
    """Which --compare variant a real run's config is (for --measured)."""
    if cfg.run.mode == "sync":
        return "sync"
    p = cfg.pipeline
    return ("flex-nolb" if not p.load_balance else "flex-nopipe" if not p.micro_batch_overlap
            else "flex-stale1" if p.max_staleness == 1 else "flex")


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
            measured.setdefault(variant_of(run_config(h5)), []).append(measure(Path(h5))["step_s"])
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


def sim_t0(path: Path) -> float:
    import h5py
    with h5py.File(path, "r") as f:
        return float(f.attrs["t0"])


def capacity(config: str, steps: int, out: Path, overrides: list[str] = ()) -> dict:
    """Zero-cost workers, the orchestrator's real compute on the clock: samples/s it drives."""
    cfg = load_config(config, [*overrides, "run.mode=flex", f"run.steps={steps}", "run.resume=false",
                               f"run.output_dir={out}", "run.checkpoint_every=0", "run.checkpoint_minutes=0"])
    wall = time.perf_counter()
    path, sim = simulate_run(cfg, ConstantCost(), out, "zero-cost", charge_orchestrator=True)
    wall = time.perf_counter() - wall
    r = measure(path, rank_devices(cfg), skip=1)
    from flexmarl_hpc.sim.msgcost import byte_cost_s
    per_s = sim.sent / max(sim.now - sim_t0(path), 1e-9)
    return {"samples_per_s": r["samples_per_s"], "step_s": r["step_s"], "wall_s": wall,
            "commands": sim.sent, "commands_per_s": per_s, "s_per_command": 1.0 / max(per_s, 1e-12),
            "s_per_byte": byte_cost_s()}


def plan(config: str, nodes: int, hardware: str, top: int, steps: int, out: Path,
         overrides: list[str] = (), baseline: bool = False) -> tuple[list[dict], dict | None]:
    """Rank splits of `nodes` in closed form, then simulate the best `top` of distinct shapes
    (sim.plan_config.distinct) in flex mode: per plan its closed-form Plan, config fragment
    and simulated result, best simulated step first; with `baseline`, also the config's own
    allocation simulated the same way (its `nodes`: every component's but the orchestrator's)."""
    cfg = load_config(config, overrides)
    try:
        hw = load_hardware(hardware)
    except HardwareError as e:
        raise ValueError(f"--hardware: {e}") from None
    classes = config_classes(cfg)
    least = min_nodes(hw, classes, cfg)
    if nodes < least:
        raise ValueError(f"--nodes: expected >= {least} for {len(cfg.agent_names)} agents on {hw.name} "
                         f"({cfg.slurm.orchestrator.nodes} orchestrator node, then per class one pool node "
                         f"and one trainer group), got {nodes}")
    work, n = plan_workload(cfg), plan_nodes(cfg, nodes)
    plans = distinct(rank_plans(hw, [c.cls for c in classes], work, n, "flex", top=10**9), top)
    data = _raw_config(config, overrides)
    rows = []
    for i, p in enumerate(plans, 1):
        frag = fragment(p, hw, classes, cfg)
        path = write_plan_config(out / f"plan{i}" / "config.yaml", data, frag)
        rows.append({"rank": i, "plan": p, "fragment": frag,
                     "sim": run_variants(str(path), ["flex"], hardware, steps, out / f"plan{i}")["flex"]})
    rows.sort(key=lambda r: r["sim"].get("step_s", float("inf")))
    if not baseline:
        return rows, None
    current = run_variants(config, ["flex"], hardware, steps, out / "config", overrides)["flex"]
    return rows, {"sim": current, "nodes": sum(c.slurm.nodes for c in components(cfg)[1:])}


def variant_mode(variant: str) -> str:
    """The run.mode a variant sets (the planner's mode for its allocation)."""
    return next(o.split("=", 1)[1] for o in VARIANTS[variant] if o.startswith("run.mode="))


def scale(config: str, sizes: list[int], variants: list[str], hardware: str, steps: int, out: Path,
          overrides: list[str] = (), progress=lambda line: None) -> list[dict]:
    """Per accelerator count (sim.scale.scale_points): the closed-form planner's best split for
    each variant's mode, pasted into a copy of the config (as --plan does) and simulated;
    a row per count with its nodes, allocation and per-variant result, or why it does not fit."""
    cfg = load_config(config, overrides)
    try:
        hw = load_hardware(hardware)
    except HardwareError as e:
        raise ValueError(f"--hardware: {e}") from None
    classes, data = config_classes(cfg), _raw_config(config, overrides)
    modes = tuple(dict.fromkeys(variant_mode(v) for v in variants))
    rows = []
    for pt in scale_points(sizes, hw, classes, plan_workload(cfg), cfg, modes):
        row = {"devices": pt.devices, "nodes": pt.nodes, "devices_used": pt.devices_used,
               "hardware": pt.hw.name, "reason": pt.reason}
        rows.append(row)
        if not pt.fits:
            progress(f"{pt.devices} accelerators: {pt.reason}")
            continue
        row["allocation"] = {m: describe_alloc(p, pt.hw) for m, p in pt.plans.items()}
        row["closed_form_step_s"] = {m: p.step_s[m] for m, p in pt.plans.items()}
        res = {}
        for m in modes:
            path = write_plan_config(out / str(pt.devices) / m / "config.yaml", data,
                                     fragment(pt.plans[m], pt.hw, classes, cfg))
            mine = [v for v in variants if variant_mode(v) == m]
            res.update(run_variants(str(path), mine, pt.hw, steps, path.parent))
        row["variants"] = {v: res[v] for v in variants}
        sync = res.get("sync", {}).get("step_s")
        for r in row["variants"].values():
            if sync and "step_s" in r:
                r["speedup_vs_sync"] = sync / r["step_s"]
        progress(f"{pt.devices} accelerators ({pt.nodes} nodes): " + ", ".join(
            f"{v} {r['step_s']:.1f} s" if "step_s" in r else f"{v} failed" for v, r in row["variants"].items())
            + f" (wall {sum(r['wall_s'] for r in res.values()):.1f} s)")
    return rows


def scale_table(rows: list[dict], variants: list[str]) -> str:
    """Accelerators, nodes, then per variant step_s and utilization (or why it does not fit)."""
    lines = [f"{'accel':>6s} {'nodes':>5s} " + " ".join(f"{v:>19s}" for v in variants),
             f"{'':12s}" + " ".join(f"{'step_s   util':>19s}" for _ in variants)]
    for r in rows:
        head = f"{r['devices_used']:6d} {r['nodes']:5d} "
        if r["reason"]:
            lines.append(f"{r['devices']:6d} {r['nodes']:5d} {r['reason']}")
            continue
        cells = []
        for v in variants:
            x = r["variants"][v]
            cells.append(f"{x['step_s']:11.1f} {x['util']:6.1%}" if "step_s" in x else f"{'failed':>18s}")
        lines.append(head + " ".join(f"{c:>19s}" for c in cells))
    return "\n".join(lines)


def scale_main(a: argparse.Namespace, out: Path) -> int:
    """`simulate scale`: runs scale(), prints, writes --png."""
    sizes, variants = parse_sizes(a.counts), variant_list(a.variants)
    wall = time.perf_counter()
    try:
        rows = scale(a.config, sizes, variants, a.hardware, a.steps, out, a.overrides,
                     progress=lambda line: print(f"scale: {line}", file=sys.stderr, flush=True))
    except (ConfigError, HardwareError, ValueError) as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - wall
    fitting = [r for r in rows if not r["reason"]]
    if a.png is not None and fitting:
        plot_scale(rows, variants, a.png, f"{Path(a.config).name} on {a.hardware}: simulated, "
                                           f"{a.steps} steps, closed-form planner's allocation per size")
    if a.json:
        print(json.dumps({"config": a.config, "hardware": a.hardware, "steps": a.steps, "wall_s": wall,
                          "sizes": rows}, indent=1))
    else:
        print(f"{a.config} on {a.hardware}, {a.steps} steps (simulated) per accelerator count; wall {wall:.1f} s")
        print(scale_table(rows, variants))
        print(bottleneck_table(rows, variants))
        if a.png is not None and fitting:
            print(f"wrote {a.png}")
    if not fitting:
        print("simulate: scale: no accelerator count fits the config's models", file=sys.stderr)
        return 1
    return 1 if any("error" in x for r in fitting for x in r["variants"].values()) else 0


def _secs(x: float) -> str:
    """Seconds with 4 significant digits: 1520.3 s on a paper config, 0.1187 on a CPU one."""
    return f"{x:.1f}" if x >= 1000 else f"{x:.4g}"


def _raw_config(config: str, overrides: list[str]) -> dict:
    """The config file's own mapping with the overrides applied (already validated)."""
    data = yaml.safe_load(Path(config).read_text()) or {}
    for o in overrides:
        apply_override(data, o)
    return data


def plan_table(rows: list[dict], hw: HardwareProfile, current: dict | None = None, wall: bool = True) -> str:
    """Closed-form and simulated flex step time and utilization per plan (best first), then
    the config's own allocation (simulated only) when given; the wall seconds each took unless
    `wall` is off (a figure that must not drift)."""
    head = (f"{'plan':5s} {'closed-form step_s':>18s} {'util':>6s} {'simulated step_s':>17s} {'util':>6s} "
            f"{'nodes':>5s}" + (f" {'wall_s':>7s}" if wall else ""))
    lines = [head]
    for r in rows:
        p, sim = r["plan"], r["sim"]
        simulated = (f"{sim['step_s']:17.1f} {sim['util']:6.1%}" if "step_s" in sim
                     else f"{'failed':>17s} {'-':>6s}")
        lines.append(f"#{r['rank']:<4d} {p.step_s['flex']:18.1f} {p.utilization['flex']:6.1%} {simulated} "
                     f"{fragment_nodes(r['fragment']):5d}" + (f" {sim['wall_s']:7.1f}" if wall else ""))
        lines += [f"      {line}" for line in describe_alloc(p, hw)]
        if "error" in sim:
            lines.append(f"      failed: {sim['error']}")
    if current is not None:
        sim = current["sim"]
        simulated = (f"{sim['step_s']:17.1f} {sim['util']:6.1%}" if "step_s" in sim
                     else f"{'failed':>17s} {'-':>6s}")
        lines.append(f"{'config':6s}{'-':>18s} {'-':>6s} {simulated} {current['nodes']:5d}"
                     + (f" {sim['wall_s']:7.1f}" if wall else ""))
        lines.append("      the config's own pools and groups")
    return "\n".join(lines)


def write_plan_config(path: Path, data: dict, frag: dict) -> Path:
    """The config file's mapping with a plan's fragment pasted in, written (atomically) to
    `path` for the simulation of that plan; returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, yaml.safe_dump(merge_fragment(data, frag), sort_keys=False))
    return path


def write_atomic(path: Path, text: str) -> None:
    """`path` is the old file or the whole new one, never half."""
    replace_file(path, text.encode())


def plan_main(a: argparse.Namespace, out: Path) -> int:
    """`simulate plan`: runs plan(), prints, writes --write."""
    try:
        rows, current = plan(a.config, a.nodes, a.hardware, a.top, a.steps, out, a.overrides, a.baseline)
        hw = load_hardware(a.hardware)
    except (ConfigError, HardwareError, ValueError) as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    best = rows[0]
    if "step_s" not in best["sim"]:
        print(plan_table(rows, hw, current))
        print("simulate: every simulated plan failed", file=sys.stderr)
        return 1
    text = best_fragment(a.config, a.nodes, a.steps, hw, best)
    if a.write is not None:
        write_atomic(a.write, text)
    if a.json:
        print(json.dumps({"config": a.config, "hardware": hw.name, "nodes": a.nodes, "steps": a.steps,
                          "plans": [{"rank": r["rank"], "closed_form_step_s": r["plan"].step_s["flex"],
                                     "closed_form_util": r["plan"].utilization["flex"], "simulated": r["sim"],
                                     "fragment": r["fragment"]} for r in rows],
                          "config_allocation": current}, indent=1))
        return 0
    print(plan_report(a.config, a.overrides, a.nodes, a.steps, hw, rows, current, a.write), end="")
    return 0


def best_fragment(config: str, nodes: int, steps: int, hw: HardwareProfile, best: dict) -> str:
    """The best plan's rollout.pools / trainer.named_groups as YAML, under a comment saying
    what was predicted for it."""
    header = [f"simulate --plan: {config}, {nodes} nodes of {hw.name} ({fragment_nodes(best['fragment'])} "
              f"for pools and groups + the orchestrator's), plan #{best['rank']} of the closed form",
              f"predicted flex step {best['sim']['step_s']:.1f} s simulated ({steps} steps), "
              f"{best['plan'].step_s['flex']:.1f} s closed form; utilization {best['sim']['util']:.1%}"]
    return fragment_yaml(best["fragment"], header)


def plan_report(config: str, overrides: list[str], nodes: int, steps: int, hw: HardwareProfile, rows: list[dict],
                current: dict | None, written: Path | None = None, wall: bool = True) -> str:
    """What `simulate plan` prints: the classes, the plans' table, the best plan's fragment."""
    classes = describe_classes(config_classes(load_config(config, overrides)))
    best = rows[0]
    return "\n".join([
        f"{config} on {hw.name}, {nodes} nodes; agent classes {classes}",
        f"the closed form's best {len(rows)} plans of distinct shapes, simulated (flex, {steps} steps), "
        f"best simulated first:",
        plan_table(rows, hw, current, wall),
        f"\nbest: plan #{best['rank']}; paste into the config{f' (written to {written})' if written else ''}:",
        best_fragment(config, nodes, steps, hw, best)])


def compare_table(config: str, hardware: str, steps: int, res: dict[str, dict], wall: bool = True) -> str:
    """Per variant: step_s, utilization, samples/s, sync's step time over the variant's (and
    the wall seconds the simulation took, unless `wall` is off: a figure that must not drift)."""
    lines = [f"{config} on {hardware}, {steps} steps (simulated)",
             f"{'variant':12s} {'step_s':>9s} {'util':>6s} {'samples/s':>10s} {'vs sync':>8s}"
             + (f" {'wall_s':>7s}" if wall else "")]
    for v, r in res.items():
        if "error" in r:
            lines.append(f"{v:12s} failed: {r['error']}")
            continue
        ratio = f"{r['speedup_vs_sync']:.2f}x" if "speedup_vs_sync" in r else "-"
        lines.append(f"{v:12s} {_secs(r['step_s']):>9s} {r['util']:6.1%} {r['samples_per_s']:10.2f} "
                     f"{ratio:>8s}" + (f" {r['wall_s']:7.1f}" if wall else ""))
    return "\n".join(lines)


def compare_main(a: argparse.Namespace, out: Path) -> int:
    """`simulate compare`: each variant simulated, a table (or JSON); exit 1 if one failed."""
    try:
        prob, factor = (float(x) for x in a.stragglers.split(":")) if a.stragglers else (0.0, 1.0)
        perturb = Perturbation(a.seed, a.jitter, prob, factor)
        res = run_variants(a.config, variant_list(a.variants), a.hardware, a.steps, out, a.overrides, a.workers,
                           perturb=perturb)
        if a.fail_at is not None:
            add_failure(res, a)
    except (ConfigError, HardwareError, ValueError) as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"config": a.config, "hardware": a.hardware, "steps": a.steps, "variants": res}, indent=1)
          if a.json else compare_table(a.config, a.hardware, a.steps, res))
    if a.fail_at is not None and not a.json:
        for v, r in res.items():
            if "done_with_failure_s" in r:
                print(f"{v}: {a.steps} steps done at {r['done_s']:.0f} s; with a node failure at {a.fail_at:g} s, "
                      f"at {r['done_with_failure_s']:.0f} s (+{r['failure_lost_s']:.0f} s)")
    return 1 if any("error" in r for r in res.values()) else 0


def add_failure(res: dict[str, dict], a: argparse.Namespace) -> None:
    """Each variant's time to finish its steps when a node fails at --fail-at (sim.perturb):
    the steps since the last checkpoint redone after --restart-s and the checkpoint's read."""
    import h5py
    for v, r in res.items():
        if "h5" not in r:
            continue
        with h5py.File(r["h5"], "r") as f:
            m = f["metrics"][:]
            cfg = run_config(r["h5"])
        t = m[m["superseded"] == 0]["t"]                 # seconds since the run's start
        cost = cost_model(cfg, load_hardware(a.hardware))
        load = checkpoint_load_s(sum(cost.state_bytes(x) for x in cfg.agent_names), a.fs_gb_s)
        ends = with_failure(t, a.checkpoint_every, Failure(a.fail_at, a.restart_s, load))
        r.update(done_s=float(t[-1]), done_with_failure_s=float(ends[-1]), failure_lost_s=float(ends[-1] - t[-1]))


def capacity_main(a: argparse.Namespace, out: Path) -> int:
    """`simulate capacity`: the orchestrator's own samples/s on this CPU."""
    try:
        res = capacity(a.config, a.steps, out / "capacity", a.overrides)
    except (ConfigError, HardwareError, ValueError) as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=1) if a.json else
          f"orchestrator capacity: {res['samples_per_s']:.0f} samples/s, {res['commands_per_s']:.0f} "
          f"commands/s ({res['commands']} commands, wall {res['wall_s']:.1f} s); per command "
          f"{res['s_per_command'] * 1e3:.3f} ms, per message byte {res['s_per_byte'] * 1e9:.2f} ns")
    return 0


# ---------------------------------------------------------------------------------------
# the command line: one subcommand per question, checked before anything runs


def variant_list(text: str) -> list[str]:
    """`sync, flex` -> ["sync", "flex"]."""
    return [v.strip() for v in text.split(",") if v.strip()]


def _flag(a: argparse.Namespace, new: str, old: str) -> str:
    """The flag as the user typed it: the subcommand's, or the deprecated form's."""
    return old if a.legacy else new


def check_common(a: argparse.Namespace) -> str | None:
    if a.steps < 3:
        return f"--steps: expected >= 3 (the first 2 steps are start-up), got {a.steps}"
    if "variants" in a:
        bad = [v for v in variant_list(a.variants) if v not in VARIANTS]
        if bad or not variant_list(a.variants):
            return (f"{_flag(a, '--variants', '--compare')}: unknown variant(s) {bad}; "
                    f"expected some of {', '.join(VARIANTS)}")
    return None


def check_plan(a: argparse.Namespace) -> str | None:
    if a.nodes is None:
        return "--nodes: required (the nodes to split, orchestrator included)"
    if a.top < 1:
        return f"--top: expected >= 1, got {a.top}"
    if a.write is not None and not a.write.parent.is_dir():
        return f"--write: folder {a.write.parent} does not exist"
    return None


def check_scale(a: argparse.Namespace) -> str | None:
    try:
        parse_sizes(a.counts, _flag(a, "--counts", "--scale"))
    except ValueError as e:
        return str(e)
    if a.png is not None and (a.png.suffix.lower() != ".png" or not a.png.parent.is_dir()):
        return f"--png: expected a .png path in an existing folder, got {a.png}"
    return None


def check_calibrate(a: argparse.Namespace) -> str | None:
    if not Path(a.run).is_file():
        return f"{_flag(a, '--run', '--calibrate')}: no such file {a.run}"
    return None


def _common_options(p: argparse.ArgumentParser, hardware: str, steps: int) -> None:
    p.add_argument("config", help="the run's config (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p.add_argument("--hardware", default=hardware, help=f"configs/hardware/<name>.yaml or a path (default {hardware})")
    p.add_argument("--steps", type=int, default=steps, help=f"simulated steps (default {steps}; >= 3)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--out", type=Path, default=None, help="folder of the simulated HDF5 files (default: a temp dir)")


def _variants_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variants", default="sync,flex", help=f"comma-separated, of {', '.join(VARIANTS)}")


def _workers_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", choices=WORKERS, default="synthetic",
                   help="synthetic: modelled responses, training skipped (any model size); real: the "
                   "real engine and trainers in this process (small models: the run trains what an MPI "
                   "run trains, only the clock is modelled)")


def compare_options(p: argparse.ArgumentParser) -> None:
    _common_options(p, "npu64_a3", 10)
    _variants_option(p)
    _workers_option(p)
    p.add_argument("--jitter", type=float, default=0.0, help="lognormal sigma of every operation's duration (mean 1)")
    p.add_argument("--stragglers", default="", metavar="PROB:FACTOR",
                   help="each operation is FACTOR times slower with probability PROB (e.g. 0.01:5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the jitter and stragglers")
    p.add_argument("--fail-at", type=float, default=None, metavar="S",
                   help="a node fails S simulated seconds in: the run restarts from its last checkpoint")
    p.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints (for --fail-at)")
    p.add_argument("--restart-s", type=float, default=300.0, help="seconds from a failure to the restarted run")
    p.add_argument("--fs-gb-s", type=float, default=10.0, help="file system GB/s reading the checkpoint back")


def plan_options(p: argparse.ArgumentParser) -> None:
    _common_options(p, "npu64_a3", 4)
    p.add_argument("--nodes", type=int, default=None, help="nodes to split (orchestrator included); required")
    p.add_argument("--top", type=int, default=3, help="closed-form plans to simulate (default 3)")
    p.add_argument("--baseline", action="store_true", help="also simulate the config's own allocation")
    p.add_argument("--write", type=Path, default=None, help="write the best plan's YAML here")


def scale_options(p: argparse.ArgumentParser) -> None:
    _common_options(p, "npu64_a3", 4)
    p.add_argument("--counts", required=True, help="accelerator counts, e.g. 1,2,4,...,3072")
    _variants_option(p)
    p.add_argument("--png", type=Path, default=None, help="write the step time / utilization curve here")


def calibrate_options(p: argparse.ArgumentParser) -> None:
    _common_options(p, "cpu_local", 10)
    p.add_argument("--run", required=True, metavar="RUN.h5", help="the real run to fit --hardware to")
    _variants_option(p)
    p.add_argument("--measured", nargs="*", default=[], metavar="H5",
                   help="real runs of the variants, to print predicted vs measured")
    p.add_argument("--write-profile", type=Path, default=None, help="write the fitted profile here")
    p.add_argument("--external-cores", type=float, default=0.0, metavar="X",
                   help="cores other processes kept busy during --run (and the --measured runs): the fit "
                        "reads the run on the cores left, the predictions run at that load (sim/hostload.py)")
    _workers_option(p)


def capacity_options(p: argparse.ArgumentParser) -> None:
    _common_options(p, "npu64_a3", 10)


def memory_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="the run's config (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p.add_argument("--hardware", default="npu64_a3", help="configs/hardware/<name>.yaml or a path: a trainer "
                   "rank's device memory is its hbm_gb (default npu64_a3)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(steps=3, out=None)            # nothing is simulated over time here
    p.add_argument("--workers", type=int, default=2, help="processes, one trainer rank each (default 2)")
    p.add_argument("--only", default="", help="comma-separated pool and group names to check (default: all)")


def memory_main(a: argparse.Namespace, out: Path) -> int:
    """`simulate memory`: peak device / host bytes of every distinct rank (sim/memory.py);
    exit 1 naming the ranks and nodes that do not fit."""
    from flexmarl_hpc.sim.memory import memory_report
    try:
        text, code = memory_report(a.config, a.overrides, a.hardware, a.json, a.workers,
                                   tuple(variant_list(a.only)))
    except (ConfigError, HardwareError, ValueError) as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    print(text)
    return code


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand: its options, the checks of its flags (a one-line error or None) and its shell."""
    help: str
    options: Callable[[argparse.ArgumentParser], None]
    check: Callable[[argparse.Namespace], str | None]
    run: Callable[[argparse.Namespace, Path], int]


COMMANDS = {
    "compare": Command("simulate the variants of a config and compare their step times",
                       compare_options, lambda a: None, compare_main),
    "plan": Command("rank splits of --nodes among pools and groups; simulate the best --top",
                    plan_options, check_plan, plan_main),
    "scale": Command("the planner's best split per accelerator count, simulated per variant",
                     scale_options, check_scale, scale_main),
    "calibrate": Command("fit --hardware to a real run, predict the variants (and compare to --measured)",
                         calibrate_options, check_calibrate, calibrate_main),
    "capacity": Command("the samples/s the orchestrator alone drives on this CPU (zero-cost workers)",
                        capacity_options, lambda a: None, capacity_main),
    "paper": Command("the paper's Tables 2-3 (MA, CA) against the simulator; --fit, --sweep",
                     paper_options, check_paper, paper_main),
    "memory": Command("peak device and host memory of every distinct rank at the config's real shapes "
                      "(fake tensors); exit 1 naming what does not fit",
                      memory_options, lambda a: None if a.workers >= 1 else
                      f"--workers: expected >= 1, got {a.workers}", memory_main),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flexmarl_hpc.simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, c in COMMANDS.items():
        sp = sub.add_parser(name, help=c.help, description=c.help)
        c.options(sp)
        sp.set_defaults(legacy=False)
    return p


def legacy_parser() -> argparse.ArgumentParser:
    """The flag forms before subcommands (`simulate CONFIG --plan --nodes 48`); every default
    None, so that only what was given is carried over to the subcommand."""
    p = argparse.ArgumentParser(prog="python -m flexmarl_hpc.simulate")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    for flag in ("--hardware", "--compare", "--calibrate", "--scale"):
        p.add_argument(flag)
    for flag in ("--steps", "--nodes", "--top"):
        p.add_argument(flag, type=int)
    for flag in ("--out", "--write", "--write-profile", "--png"):
        p.add_argument(flag, type=Path)
    for flag in ("--json", "--capacity", "--plan", "--baseline"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--measured", nargs="*", default=[])
    p.add_argument("--workers", choices=WORKERS)
    return p


LEGACY_OPTIONS = [  # (dest, the subcommand's flag, subcommands that take it)
    ("hardware", "--hardware", tuple(COMMANDS)), ("steps", "--steps", tuple(COMMANDS)),
    ("json", "--json", tuple(COMMANDS)), ("out", "--out", tuple(COMMANDS)),
    ("compare", "--variants", ("compare", "scale", "calibrate")), ("workers", "--workers", ("compare", "calibrate")),
    ("nodes", "--nodes", ("plan",)), ("top", "--top", ("plan",)), ("baseline", "--baseline", ("plan",)),
    ("write", "--write", ("plan",)), ("scale", "--counts", ("scale",)), ("png", "--png", ("scale",)),
    ("calibrate", "--run", ("calibrate",)), ("measured", "--measured", ("calibrate",)),
    ("write_profile", "--write-profile", ("calibrate",)),
]


def legacy_argv(argv: list[str]) -> tuple[list[str], str]:
    """The subcommand's command line for a deprecated flag form, and the form's mode flag;
    ValueError (one line) for flags the old form refused together."""
    a = legacy_parser().parse_args(argv)
    if a.workers == "real" and (a.plan or a.capacity or a.scale is not None):
        raise ValueError("--workers real: only with --compare or --calibrate (plans and scales are for "
                         "models too large to run here)")
    if a.png is not None and a.scale is None:
        raise ValueError("--png: only with --scale")
    if a.scale is not None and (a.plan or a.capacity):
        raise ValueError("--scale: not with --plan or --capacity")
    name, flag = next((n, f) for n, f, on in (
        ("scale", "--scale", a.scale is not None), ("plan", "--plan", a.plan),
        ("calibrate", "--calibrate", a.calibrate),
        ("capacity", "--capacity", a.capacity), ("compare", "--compare", a.compare is not None),
        ("compare", "", True)) if on)
    new = [name, a.config, *a.overrides]
    for dest, opt, takers in LEGACY_OPTIONS:
        value = getattr(a, dest)
        if name not in takers or value is None or value is False or value == []:
            continue
        new += [opt] if value is True else [opt, *map(str, value)] if isinstance(value, list) else [opt, str(value)]
    return new, flag


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    notice = None
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        try:
            argv, flag = legacy_argv(argv)
        except ValueError as e:
            print(f"simulate: {e}", file=sys.stderr)
            return 2
        notice = (f"simulate: 'simulate CONFIG{' ' + flag if flag else ''}' is deprecated; "
                  f"use 'simulate {shlex.join(argv)}'")
    a = parser().parse_args(argv)
    a.legacy = notice is not None
    command = COMMANDS[a.command]
    error = check_common(a) or command.check(a)
    if error:
        print(f"simulate: {error}", file=sys.stderr)
        return 2
    if notice:
        print(notice, file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        return command.run(a, a.out or Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
