"""Simulate a config at cluster scale: the real orchestrator on a discrete-event clock.

    python -m flexmarl_hpc.simulate compare configs/paper_3x32b_7x14b.yaml --variants sync,flex
    python -m flexmarl_hpc.simulate compare configs/paper_5x32b.yaml --hardware h100_ndr --steps 10 --json
    python -m flexmarl_hpc.simulate plan configs/paper_3x32b_7x14b.yaml --nodes 48 --top 3 --write plan48.yaml
    python -m flexmarl_hpc.simulate scale configs/paper_3x32b_7x14b.yaml --counts 1,2,4,768 --png scale.png
    python -m flexmarl_hpc.simulate calibrate configs/skewed.yaml --run runs/skewed/skewed.h5 --workers real
    python -m flexmarl_hpc.simulate capacity configs/local.yaml        # the orchestrator's own limit
    python -m flexmarl_hpc.simulate memory configs/paper_3x32b_7x14b.yaml   # peak memory per rank (fake tensors)

Each subcommand takes CONFIG, key=value overrides, --hardware, --steps, --json and --out;
`python -m flexmarl_hpc.simulate SUBCOMMAND --help` lists the rest.

compare: each variant (--variants) runs the real Orchestrator, scheduler, Experience,
workflow and rewards over sim.transport.SimTransport. Its workers (--workers) are synthetic
(responses of modelled length, training skipped: any model size) or real (the real engine
and trainers in this process, for small models: the run trains what an MPI run of the config
trains, and only the clock is modelled, from the lengths the policy really generates).
Both are priced by sim.costs (see sim/driver.py for what is modelled and docs/simulator.md
"Cost model assumptions"). Each writes
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
import sys
import tempfile
from pathlib import Path
from typing import Callable

from flexmarl_hpc.sim.calibrate_cli import calibrate_main, calibrate_options, check_calibrate
from flexmarl_hpc.sim.capacity_cli import capacity_main, capacity_options
from flexmarl_hpc.sim.cli_options import check_common
from flexmarl_hpc.sim.compare_cli import check_compare, compare_main, compare_options
from flexmarl_hpc.sim.memory_cli import memory_main, memory_options
from flexmarl_hpc.sim.paper_cli import check_paper, paper_main, paper_options
from flexmarl_hpc.sim.plan_cli import check_plan, plan_main, plan_options
from flexmarl_hpc.sim.scale_cli import check_scale, scale_main, scale_options


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand: its options, the checks of its flags (a one-line error or None) and its shell."""
    help: str
    options: Callable[[argparse.ArgumentParser], None]
    check: Callable[[argparse.Namespace], str | None]
    run: Callable[[argparse.Namespace, Path], int]


COMMANDS = {
    "compare": Command("simulate the variants of a config and compare their step times",
                       compare_options, check_compare, compare_main),
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
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        # the flag forms before subcommands (`simulate CONFIG --plan`) were removed on 2026-11-29
        print(f"simulate: expected a subcommand ({', '.join(COMMANDS)}) first, got {argv[0]!r}: "
              f"e.g. 'simulate compare {argv[0]} ...'", file=sys.stderr)
        return 2
    a = parser().parse_args(argv)
    command = COMMANDS[a.command]
    error = check_common(a) or command.check(a)
    if error:
        print(f"simulate: {error}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        return command.run(a, a.out or Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
