"""`simulate capacity`: the orchestrator alone on zero-cost workers, its real compute charged
to the clock: the samples/s the single orchestrator rank drives on this CPU.

    python -m flexmarl_hpc.simulate capacity configs/local.yaml
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from flexmarl_hpc.config.load import load_plan
from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.sim.cli_options import common_options
from flexmarl_hpc.sim.driver import measure, rank_devices, simulate_run
from flexmarl_hpc.sim.hardware import HardwareError
from flexmarl_hpc.sim.runs import sim_t0
from flexmarl_hpc.sim.transport import ConstantCost


def capacity(config: str, steps: int, out: Path, overrides: list[str] = ()) -> dict:
    """Zero-cost workers, the orchestrator's real compute on the clock: samples/s it drives."""
    plan = load_plan(config, [*overrides, "run.mode=flex", f"run.steps={steps}", "run.resume=false",
                               f"run.output_dir={out}", "run.checkpoint_every=0", "run.checkpoint_minutes=0"])
    wall = time.perf_counter()
    path, sim = simulate_run(plan, ConstantCost(), out, "zero-cost", charge_orchestrator=True)
    wall = time.perf_counter() - wall
    r = measure(path, rank_devices(plan), skip=1)
    from flexmarl_hpc.sim.msgcost import byte_cost_s
    per_s = sim.sent / max(sim.now - sim_t0(path), 1e-9)
    return {"samples_per_s": r["samples_per_s"], "step_s": r["step_s"], "wall_s": wall,
            "commands": sim.sent, "commands_per_s": per_s, "s_per_command": 1.0 / max(per_s, 1e-12),
            "s_per_byte": byte_cost_s()}


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


def capacity_options(p: argparse.ArgumentParser) -> None:
    common_options(p, "npu64_a3", 10)

