"""The simulated runs behind `simulate compare`, `plan` and `scale`: a variant's config
(VARIANTS: the ablations and the baselines of sim/baselines.py), how it is priced, the run
itself (sim.driver) and what is measured from its HDF5 file.

    from flexmarl_hpc.sim.runs import run_variants
    run_variants("configs/paper_3x32b_7x14b.yaml", ["sync", "flex"], "npu64_a3", 10, Path("out"))
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import yaml

from flexmarl_hpc.config.load import apply_override, load_plan
from flexmarl_hpc.sim.baselines import FRAGMENTS, SYNC_NO_LB, colocated_run, system_config
from flexmarl_hpc.sim.driver import (Workload, cost_model, measure, rank_devices, replica_ranks, simulate_run,
                                     sync_per_generate)
from flexmarl_hpc.sim.hardware import HardwareProfile, load_hardware
from flexmarl_hpc.sim.perturb import Perturbation
from flexmarl_hpc.sim.plan_config import merge_fragment
from flexmarl_hpc.store.checkpoint import replace_file


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
    """(plan, colocated (pool, group) pairs) of one --compare variant, writing under
    `out`/<variant>, no checkpoints; a baseline with its own allocation (marti, mas-rl) gets
    it on the config's nodes of `hw` (sim/baselines.py)."""
    common = [*overrides, *VARIANTS[variant], f"run.steps={steps}", "run.resume=false",
              f"run.output_dir={out / variant}", "run.checkpoint_every=0", "run.checkpoint_minutes=0"]
    if variant not in FRAGMENTS:
        return load_plan(config, common), []
    raw = yaml.safe_load(Path(config).read_text())
    return system_config(raw, variant, hw or load_hardware("npu64_a3"), common, out / variant / "config")


def priced(plan, hw: HardwareProfile, workers: str):
    """The cost model and modelled workload of a run: synthetic workers price the config's
    model shape with Qwen's vocabulary and modelled lengths (bf16); real ones the models as
    they run here (the task's vocabulary, fp32) and the lengths they produce. An episode
    workflow states its own lengths (each call's max_tokens, which a synthetic reply fills:
    workflows/paper_text.py draws them from the paper's distributions): those are priced."""
    if workers == "synthetic":
        return cost_model(plan, hw), (None if plan.cfg.workflow.episode else Workload())
    return local_cost(plan, hw), None


def local_cost(plan, hw: HardwareProfile):
    """The plan's models priced as they run on this machine: the task's vocabulary, fp32."""
    from flexmarl_hpc.workflows.build import build_task
    return cost_model(plan, hw, len(build_task(plan.cfg).vocab), 4)


def run_variants(config: str, variants: list[str], hardware: str | HardwareProfile, steps: int, out: Path,
                 overrides: list[str] = (), workers: str = "synthetic",
                 perturb: Perturbation | None = None) -> dict[str, dict]:
    hw = hardware if isinstance(hardware, HardwareProfile) else load_hardware(hardware)
    results = {}
    for v in variants:
        plan, pairs = variant_config(config, v, steps, out, overrides, hw)
        wall = time.perf_counter()
        try:
            cost, work = priced(plan, hw, workers)
            wrap, devices = colocated_run(plan, cost, hw, pairs)
            path, sim = simulate_run(plan, cost, out / v, hw.name, work, workers=workers, wrap=wrap, colocate=pairs,
                                     perturb=perturb)
        except RuntimeError as e:      # e.g. the orchestrator waits with nothing in flight
            results[v] = {"error": str(e), "wall_s": time.perf_counter() - wall}
            continue
        r = measure(path, rank_devices(plan), devices=devices)
        r.update(wall_s=time.perf_counter() - wall, sim_s=sim.now - sim_t0(path), h5=str(path),
                 orchestrator_share=sim.orchestrator_charged / max(sim.now - sim_t0(path), 1e-12),
                 sync_per_generate=sync_per_generate(path, replica_ranks(plan)))
        results[v] = r
    if "step_s" in results.get("sync", {}):
        for r in results.values():
            if "step_s" in r:
                r["speedup_vs_sync"] = results["sync"]["step_s"] / r["step_s"]
    return results


def run_config(path: str | Path):
    """The plan of the config a run's HDF5 file was made with (its config_yaml attribute)."""
    import h5py
    with h5py.File(path, "r") as f:
        text = f.attrs["config_yaml"]
    raw = yaml.safe_load(text if isinstance(text, str) else text.decode())
    # a file written before run.idle_wait existed: its ranks polled (the default is doorbell)
    raw.setdefault("run", {}).setdefault("idle_wait", "poll")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as tmp:
        tmp.write(yaml.safe_dump(raw, sort_keys=False))
        tmp.flush()
        return load_plan(tmp.name)


def sim_t0(path: Path) -> float:
    import h5py
    with h5py.File(path, "r") as f:
        return float(f.attrs["t0"])


def variant_of(cfg) -> str:
    """Which --compare variant a real run's config is (for --measured)."""
    if cfg.run.mode == "sync":
        return "sync"
    p = cfg.pipeline
    return ("flex-nolb" if not p.load_balance else "flex-nopipe" if not p.micro_batch_overlap
            else "flex-stale1" if p.max_staleness == 1 else "flex")


def variant_mode(variant: str) -> str:
    """The run.mode a variant sets (the planner's mode for its allocation)."""
    return next(o.split("=", 1)[1] for o in VARIANTS[variant] if o.startswith("run.mode="))


def variant_list(text: str) -> list[str]:
    """`sync, flex` -> ["sync", "flex"]."""
    return [v.strip() for v in text.split(",") if v.strip()]


def raw_config(config: str, overrides: list[str]) -> dict:
    """The config file's own mapping with the overrides applied (already validated)."""
    data = yaml.safe_load(Path(config).read_text()) or {}
    for o in overrides:
        apply_override(data, o)
    return data


def write_plan_config(path: Path, data: dict, frag: dict) -> Path:
    """The config file's mapping with a plan's fragment pasted in, written (atomically) to
    `path` for the simulation of that plan; returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, yaml.safe_dump(merge_fragment(data, frag), sort_keys=False))
    return path


def write_atomic(path: Path, text: str) -> None:
    """`path` is the old file or the whole new one, never half."""
    replace_file(path, text.encode())

