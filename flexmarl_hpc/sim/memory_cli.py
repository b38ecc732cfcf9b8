"""`simulate memory`: the shell of sim/memory.py (peak memory of every distinct rank).

    python -m flexmarl_hpc.simulate memory configs/paper_3x32b_7x14b.yaml
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.sim.hardware import HardwareError
from flexmarl_hpc.sim.runs import variant_list


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

