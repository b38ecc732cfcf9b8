"""The options every `simulate` subcommand shares, and their checks (a one-line error or None)."""
from __future__ import annotations

import argparse
from pathlib import Path

from flexmarl_hpc.sim.driver import WORKERS
from flexmarl_hpc.sim.runs import VARIANTS, variant_list


def check_common(a: argparse.Namespace) -> str | None:
    if a.steps < 3:
        return f"--steps: expected >= 3 (the first 2 steps are start-up), got {a.steps}"
    if "variants" in a:
        bad = [v for v in variant_list(a.variants) if v not in VARIANTS]
        if bad or not variant_list(a.variants):
            return (f"--variants: unknown variant(s) {bad}; "
                    f"expected some of {', '.join(VARIANTS)}")
    return None


def common_options(p: argparse.ArgumentParser, hardware: str, steps: int) -> None:
    p.add_argument("config", help="the run's config (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p.add_argument("--hardware", default=hardware, help=f"configs/hardware/<name>.yaml or a path (default {hardware})")
    p.add_argument("--steps", type=int, default=steps, help=f"simulated steps (default {steps}; >= 3)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--out", type=Path, default=None, help="folder of the simulated HDF5 files (default: a temp dir)")


def variants_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variants", default="sync,flex", help=f"comma-separated, of {', '.join(VARIANTS)}")


def workers_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", choices=WORKERS, default="synthetic",
                   help="synthetic: modelled responses, training skipped (any model size); real: the "
                   "real engine and trainers in this process (small models: the run trains what an MPI "
                   "run trains, only the clock is modelled)")

