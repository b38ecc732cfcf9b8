"""Run a multi-agent RL job: one MPI world, split by role.

    python -m flexmarl_hpc.run configs/local.yaml                  # re-launches under mpiexec
    python -m flexmarl_hpc.run configs/local.yaml run.mode=flex trainer.lr=3e-4
    mpiexec -n 4 python -m flexmarl_hpc.run configs/local.yaml     # explicit launch
    srun --mpi=pmi2 --het-group=0 CMD : --het-group=1 CMD : ...  # inside a Slurm job
    python -m flexmarl_hpc.run configs/math_team.yaml tools.ranks=1   # tool calls on a rank of their own
    python -m flexmarl_hpc.run --help-config                       # every field, with help

Started outside MPI it checks the config, then re-executes itself under the venv's
`mpiexec` with the number of ranks the layout needs; under MPI each rank runs
ranks/job.py (`run_rank`). Exit codes: 0 done, 2 bad config or
run.output_dir in use by another run (flexmarl_hpc.store.lock), 75 (EXIT_REQUEUE: the Slurm
script requeues on it) preempted after a clean checkpoint, a worker lost or hung, or a full
disk; 1 any other error, a store found damaged included (docs/reliability.md), and a step in
which more than workflow.max_failure_rate of the episodes failed (docs/episodes.md).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from flexmarl_hpc.config.load import help_text, load_plan, to_dict
from flexmarl_hpc.config.schema import Config, ConfigError
from flexmarl_hpc.launch.preflight import check_output_dir, preflight
from flexmarl_hpc.store.lock import RunLock, acquire, hand_down

MPI_ENV = ("PMI_RANK", "PMI_FD", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m flexmarl_hpc.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", help="YAML config file")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-4")
    ap.add_argument("--help-config", action="store_true", help="list every config field")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return ap.parse_args(argv)


def under_mpi() -> bool:
    return any(k in os.environ for k in MPI_ENV)


def mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if not found:
        raise SystemExit("mpiexec not found: install the mpich wheel (pip install mpich) or load an MPI module")
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.help_config:
        print(help_text())
        return 0
    if not args.config:
        print("usage: python -m flexmarl_hpc.run CONFIG [key=value ...]", file=sys.stderr)
        return 2
    try:
        plan = load_plan(args.config, args.overrides)
        cfg, layout = plan.cfg, plan.layout
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        import yaml
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
    launcher_lock = None
    try:
        # a folder the run can write (judged without writing), then one run per folder, checked
        # before anything in it is read, repaired or written (the store's open-flag repair in
        # preflight's check_resumable, config.yaml, train.log)
        check_output_dir(cfg)
        if under_mpi():
            from flexmarl_hpc.ranks.job import hold_run_lock     # collective: imports MPI
            if not hold_run_lock(cfg):
                return 2
        elif cfg.output_dir.is_dir():             # taken now: a late second run is refused here,
            launcher_lock = take_lock(cfg)        # before its pre-launch checks (seconds)
        preflight(plan, local=not under_mpi())
        if not under_mpi() and launcher_lock is None:
            # a new folder: taken after the checks, so a refused config leaves no folder behind
            launcher_lock = take_lock(cfg)
    except ConfigError as e:
        if launcher_lock is not None:
            launcher_lock.release()
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if not under_mpi():
        hand_down(launcher_lock)
        cmd = [mpiexec(), "-n", str(layout.world_size), sys.executable, "-m", "flexmarl_hpc.run",
               args.config, *args.overrides]
        print(f"launching {layout.world_size} ranks: {' '.join(cmd)}", flush=True)
        os.execv(cmd[0], cmd)
    from flexmarl_hpc.ranks.job import run_rank
    return run_rank(plan)


def take_lock(cfg: Config) -> RunLock:
    """The launcher's lock on run.output_dir, held by mpiexec after the exec (hand_down)."""
    return acquire(cfg.output_dir, lambda line: print(line, file=sys.stderr, flush=True))


if __name__ == "__main__":
    sys.exit(main())
