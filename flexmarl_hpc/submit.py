"""Submit a run to Slurm from a login node, as one heterogeneous job.

    python -m flexmarl_hpc.submit configs/local.yaml run.steps=200           # submit; prints id, logs, store
    python -m flexmarl_hpc.submit configs/local.yaml --dry-run               # print the job script only
                                                   # (and the component table on stderr)
    python -m flexmarl_hpc.submit configs/local.yaml --single                # one allocation instead
    python -m flexmarl_hpc.submit configs/local.yaml --wait --timeout 7200   # and block until it ends
    python -m flexmarl_hpc.submit configs/local.yaml --sweep trainer.lr=1e-3,3e-4   # one array task per value

The config is validated, and the `slurm:` section checked against the partitions `sinfo`
reports, before anything is submitted. The resolved config and the job script go to
run.output_dir (`config.yaml`, `job.sbatch`, and `logs/<jobid>.sbatch` per submission);
the job writes `logs/<jobid>.out|err` (append mode: a requeued job continues them), the
store `<run.name>.h5` and `checkpoints/`. Exit codes: 0 submitted (with --wait: completed),
1 sbatch failed or the job did not complete, 2 bad config.

From Python, `submit(...)` returns a `SlurmRun`, a submitit job that behaves like a Future:

    run = submit("configs/local.yaml", ["run.steps=100"])
    run.state            # PENDING, RUNNING, COMPLETED ... (sacct, through submitit's watcher)
    run.done()           # terminal state reached
    run.wait(timeout=600)          # TimeoutError after 600 s; releases requeue holds on the way
    run.result(timeout=600)        # the HDF5 path, or FailedJobError with the log tail
    run.cancel()                   # scancel
    run.signal("USR1")             # checkpoint, exit 75, requeue: what --signal does before the limit

submitit fits the parts that do not depend on the job's shape: its sacct watcher (taught
here that sacct lists a het job as J+0, J+1, ...), its Job API, and for sweeps its
`map_array`, checkpoint and requeue machinery. It cannot write a het job (its issue 1741)
and Slurm has no arrays of het jobs, so a sweep runs each value as one allocation.
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import submitit
from submitit.core.utils import FailedJobError, JobPaths
from submitit.slurm.slurm import SlurmInfoWatcher

from flexmarl_hpc.config.load import load_config, load_plan, save_config
from flexmarl_hpc.config.plan import Plan, component_table
from flexmarl_hpc.config.schema import Config, ConfigError
from flexmarl_hpc.config.validate_slurm import parse_time, validate_slurm
from flexmarl_hpc.launch.owner import check_owner
from flexmarl_hpc.launch.preflight import (Partition, check_capacity, check_output_dir, check_resumable,
                                          cluster_partitions)
from flexmarl_hpc.launch.sbatch import EXIT_REQUEUE, hetjob_script, sbatch_option_items, single_script
from flexmarl_hpc.store.lock import check_free

TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
                      "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"})
"""Job states after which nothing more happens (without a human)."""
TRANSIENT = frozenset({"UNKNOWN", "PREEMPTED", "REQUEUED"})
"""sacct states that may hide a live job: a requeued job's old record, or none yet."""


def _slurm(cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    """A Slurm client command, bounded (a wedged slurmctld must not hang the caller)."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------------------
# preparing and submitting a het job
# ---------------------------------------------------------------------------------------
class Prepared(NamedTuple):
    plan: Plan                      # resolved once (config/plan.py)
    script: str
    overrides: list[str]            # as passed to the job: run.output_dir made absolute

    @property
    def cfg(self) -> Config:
        return self.plan.cfg


def prepare(config_path: str, overrides: list[str], single: bool = False,
            partitions: tuple[dict[str, Partition], str] | None = None) -> Prepared:
    """Load and check the config, make run.output_dir absolute, write nothing.

    Raises ConfigError naming the field. `partitions` (from `cluster_partitions()`) adds
    the capacity check; None skips it (no Slurm here, e.g. a dry run on a laptop).
    """
    cfg = load_config(config_path, overrides)
    out = cfg.output_dir.resolve()
    # the job must find the same folder whatever its working directory; {name} is resolved
    overrides = [o for o in overrides if not o.startswith("run.output_dir=")] + [f"run.output_dir={out}"]
    plan = load_plan(config_path, overrides)
    validate_slurm(plan)
    check_output_dir(plan.cfg)      # submit writes job.sbatch there before any job starts
    if partitions is not None:
        check_capacity(plan, *partitions, single=single)
    make = single_script if single else hetjob_script
    return Prepared(plan, make(plan, str(Path(config_path).resolve()), overrides, python=sys.executable),
                    overrides)


def check_writable(cfg: Config) -> None:
    """Refuse (ConfigError, one line) a run folder another run holds (its lock), a Slurm job
    may still write (pending, held, requeued: it holds no lock yet), or whose store is
    truncated, damaged or foreign; the folder stays as it was, config.yaml included."""
    check_free(cfg.output_dir)
    check_owner(cfg.output_dir)
    check_resumable(cfg)


def submit(config_path: str, overrides: list[str] = (), single: bool = False,
           check_partitions: bool = True) -> "SlurmRun":
    """Validate, write config.yaml + job.sbatch into run.output_dir, sbatch it.

    Equivalent to: sbatch --parsable OUT/job.sbatch (the text of `prepare`).
    """
    parts = cluster_partitions() if check_partitions else None
    prep = prepare(config_path, list(overrides), single, parts)
    cfg, script = prep.cfg, prep.script
    out = cfg.output_dir
    check_writable(cfg)           # before anything in the folder is written
    (out / "logs").mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    path = out / "job.sbatch"
    path.write_text(script)
    p = _slurm(["sbatch", "--parsable", str(path)], timeout=120)
    if p.returncode != 0:
        raise RuntimeError(f"sbatch refused {path}: {p.stderr.strip()}")
    job_id = p.stdout.strip().split(";")[0]       # "ID" or "ID;cluster"
    (out / "logs" / f"{job_id}.sbatch").write_text(script)   # what this id ran, kept per submission
    return SlurmRun(out, job_id, out / f"{cfg.run.name}.h5")


# ---------------------------------------------------------------------------------------
# the job handle
# ---------------------------------------------------------------------------------------
class HetInfoWatcher(SlurmInfoWatcher):
    """submitit's sacct watcher, for het jobs too.

    sacct lists a het job J as J+0, J+1, ... (one record per component) and never as J,
    so submitit's own watcher reports UNKNOWN forever. Component 0 runs the batch script:
    its record is the job's state and exit code.
    """

    def _make_command(self) -> list[str] | None:
        cmd = super()._make_command()
        # bounded: submitit waits on sacct without a limit; a killed sacct is a logged miss
        return None if cmd is None else ["timeout", "30", *cmd]

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        info = super().read_info(string)
        for key, stats in list(info.items()):
            main, plus, comp = key.partition("+")
            if plus and comp == "0":
                info[main] = stats
        return info


class RunPaths(JobPaths):
    """Log paths of a flexmarl_hpc job: OUT/logs/<jobid>.out|err (the script's --output)."""

    @property
    def stdout(self) -> Path:
        return self._format_id(self.folder / "%j.out")

    @property
    def stderr(self) -> Path:
        return self._format_id(self.folder / "%j.err")


class SlurmRun(submitit.SlurmJob):
    """A submitted run (het job or single allocation), usable like a Future.

    Wraps an existing job id: `SlurmRun(output_dir, "4242")` reattaches to a run submitted
    earlier (even by plain `sbatch slurm/flexmarl_hetjob.sbatch`).
    """

    watcher = HetInfoWatcher(delay_s=60)

    def __init__(self, output_dir: Path | str, job_id: str, h5_path: Path | str | None = None) -> None:
        out = Path(output_dir).absolute()
        super().__init__(folder=out / "logs", job_id=str(job_id))
        self._paths = RunPaths(out / "logs", job_id=str(job_id))
        self.output_dir = out
        self.h5_path = Path(h5_path) if h5_path else out / f"{load_config(out / 'config.yaml').run.name}.h5"
        self.released = 0                         # requeue holds released by wait()
        self._pending_since: float | None = None

    # -- state -------------------------------------------------------------------------
    def scontrol(self) -> dict[str, str]:
        """`scontrol show job -o J` of component 0 as a dict ({} once Slurm forgot the job)."""
        try:
            p = _slurm(["scontrol", "show", "job", "-o", self.job_id])
        except (OSError, subprocess.TimeoutExpired):
            return {}
        first = p.stdout.splitlines()[0] if p.returncode == 0 and p.stdout.strip() else ""
        return dict(kv.split("=", 1) for kv in first.split() if "=" in kv)

    def get_state(self, mode: str = "standard") -> str:
        """sacct's state (submitit's watcher), or slurmctld's while sacct lags behind a
        requeue or has no record yet (or no accounting at all). A terminal sacct state is
        checked against slurmctld too, which is right while it remembers the job: a job
        requeued by hand after it ended FAILED keeps that record in sacct until it starts
        again, and ended COMPLETED while sacct still said FAILED (seen in
        tests/slurm/test_dead_rank_slurm.py)."""
        st = (self.watcher.get_state(self.job_id, mode=mode).split() or ["UNKNOWN"])[0]
        if st in TRANSIENT or st in TERMINAL:
            st = self.scontrol().get("JobState", st)           # {} once slurmctld forgot it
        return st

    @property
    def state(self) -> str:
        return self.get_state("standard")

    def done(self, force_check: bool = False) -> bool:
        return self.get_state("force" if force_check else "standard") in TERMINAL

    # -- waiting -----------------------------------------------------------------------
    def release_requeue_hold(self) -> bool:
        """Start a requeued job now instead of after Slurm's credential-lifetime hold.

        Slurm sets BeginTime = end + cred_expire (120 s by default) when a requeued job has
        ended, which the job itself cannot undo. The hold only protects the new launch
        credential from the old one's revocation, which needs one second between them:
        release once the job has been seen pending for 2 s. Equivalent to:
        scontrol update jobid=J StartTime=now
        """
        info = self.scontrol()
        held = (info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime"
                and int(info.get("Restarts", "0")) > 0)
        if not held:
            self._pending_since = None
            return False
        now = time.monotonic()
        if self._pending_since is None:
            self._pending_since = now
        if now - self._pending_since < 2.0:
            return False
        p = _slurm(["scontrol", "update", f"jobid={self.job_id}", "StartTime=now"])
        self._pending_since = None
        self.released += p.returncode == 0
        return p.returncode == 0

    def wait(self, timeout: float = 3600.0, poll: float = 2.0, release_requeued: bool = True) -> str:
        """Block until the job reaches a terminal state and return it.

        TimeoutError after `timeout` seconds (the job keeps running). With
        `release_requeued`, a job requeued after a preemption signal starts again at once.
        """
        deadline = time.monotonic() + timeout
        while True:
            st = self.get_state("force")
            if st in TERMINAL:
                return st
            if release_requeued:
                self.release_requeue_hold()
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} still {st} after {timeout:.0f} s")
            time.sleep(poll)

    def exception(self, timeout: float = 3600.0) -> FailedJobError | None:
        """None if the job completed, else the error with the tail of its logs."""
        st = self.wait(timeout)
        if st == "COMPLETED":
            return None
        tails = []
        for path in (self.paths.stderr, self.paths.stdout):
            if path.exists():
                tails.append(f"--- {path} (tail)\n{path.read_text(errors='replace')[-3000:]}")
        return FailedJobError(f"job {self.job_id} ended {st}\n" + "\n".join(tails))

    def result(self, timeout: float = 3600.0) -> Path:
        """The run's HDF5 store once the job completed; FailedJobError otherwise."""
        err = self.exception(timeout)
        if err is not None:
            raise err
        return self.h5_path

    def results(self, timeout: float = 3600.0) -> list[Path]:
        return [self.result(timeout)]

    # -- acting on it ------------------------------------------------------------------
    def cancel(self, check: bool = True) -> None:
        """scancel J: every component of a het job. The store and checkpoints stay."""
        p = _slurm(["scancel", self.job_id])
        if check and p.returncode != 0:
            raise RuntimeError(f"scancel {self.job_id}: {p.stderr.strip()}")

    def signal(self, sig: str = "USR1", full: bool = False) -> None:
        """Signal the ranks (with `full`, the batch shell too): USR1 or TERM make the run
        checkpoint, exit 75 and requeue. Equivalent to: scancel --signal=USR1 J"""
        cmd = ["scancel", f"--signal={sig}", *(["--full"] if full else []), self.job_id]
        p = _slurm(cmd)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {p.stderr.strip()}")

    def __repr__(self) -> str:
        return f"SlurmRun<job_id={self.job_id}, state={self.state}, store={self.h5_path}>"


# ---------------------------------------------------------------------------------------
# sweeps: a submitit job array, one single allocation per value
# ---------------------------------------------------------------------------------------
class SweepRun(submitit.helpers.Checkpointable):
    """One run of a sweep. submitit calls it on every task of the allocation; srun
    --mpi=pmi2 made the tasks one MPI world, so this is `python -m flexmarl_hpc.run`.

    submitit's own preemption handler (SIGUSR2, from `--signal=USR2@N`) would pickle this
    callable and requeue from task 0 alone while the other ranks sit in MPI calls; the
    run's protocol (every rank checkpoints, then exits 75) is handed the signal instead,
    and task 0 requeues once every rank is past it. Being Checkpointable, a requeued task
    calls this again with the same arguments: the run resumes from its output_dir.
    """

    def __call__(self, config_path: str, overrides: list[str]) -> str:
        from flexmarl_hpc import run
        signal.signal(signal.SIGUSR2, _usr2_to_run)
        code = run.main([config_path, *overrides])
        if code == EXIT_REQUEUE:
            from mpi4py import MPI
            MPI.COMM_WORLD.Barrier()          # every rank has checkpointed
            env = submitit.JobEnvironment()
            if env.global_rank == 0:
                # the array task's own id (SLURM_JOB_ID), not ARRAYID_TASK: one element only
                subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], timeout=60)
            # not a result: submitit writes none for SystemExit, so the client keeps waiting
            raise SystemExit(EXIT_REQUEUE)
        if code != 0:
            raise RuntimeError(f"flexmarl_hpc.run exited {code}")
        cfg = load_config(config_path, overrides)
        return str(cfg.output_dir / f"{cfg.run.name}.h5")


def _usr2_to_run(signum, frame) -> None:
    # flexmarl_hpc.run installs its SIGUSR1 handler (set the preempt flag) once it runs;
    # before that there is nothing to checkpoint and submitit's requeue is not wanted either
    handler = signal.getsignal(signal.SIGUSR1)
    if callable(handler):
        handler(signal.SIGUSR1, frame)


def sweep_overrides(overrides: list[str], sweep: str, base_out: Path) -> list[list[str]]:
    """`key=v1,v2` -> one override list per value, each with its own output_dir
    (BASE/key=value), so the runs never share a store or checkpoints."""
    key, _, values = sweep.partition("=")
    vals = [v for v in values.split(",") if v]
    if not key or not vals or "=" in values:
        raise ConfigError(f"--sweep {sweep!r}: expected key=v1,v2,...")
    base = [o for o in overrides if not o.startswith("run.output_dir=") and not o.startswith(f"{key}=")]
    return [base + [f"{key}={v}", f"run.output_dir={base_out / f'{key}={v}'}"] for v in vals]


def sweep_parameters(plan: Plan) -> dict[str, object]:
    """submitit SlurmExecutor parameters for one allocation of this config's world (pure).

    The array it writes is roughly: #SBATCH --array=0-K --ntasks=WORLD --nodes=N
    --cpus-per-task=C --signal=USR2@S --requeue --open-mode=append, then
    srun --mpi=pmi2 --cpus-per-task=C python -u -m submitit.core._submit FOLDER
    """
    cfg = plan.cfg
    s, comp = cfg.slurm, plan.single
    secs = parse_time(s.time)
    extra: dict[str, object] = {**sbatch_option_items([*s.sbatch_options, *comp.sbatch_options]),
                                "ntasks": plan.layout.world_size, "requeue": True}
    params: dict[str, object] = dict(
        job_name=f"{cfg.run.name}-sweep", nodes=comp.nodes, cpus_per_task=comp.cpus_per_task,
        signal_delay_s=s.signal_seconds or 60, setup=list(s.setup),
        # srun takes no --cpus-per-task from the allocation since Slurm 22.05; the GPUs of a
        # node are shared out by role (flexmarl_hpc.runtime.devices), as in single_script
        srun_args=[f"--mpi={s.mpi}", f"--cpus-per-task={comp.cpus_per_task}",
                   *(["--gpu-bind=none"] if comp.gpus_per_node else [])])
    if secs is None:
        extra["time"] = s.time
    else:
        params["time"] = math.ceil(secs / 60)
    for key, value in (("gpus_per_node", comp.gpus_per_node), ("mem", comp.mem),
                       ("partition", comp.partition or s.partition), ("account", s.account),
                       ("qos", s.qos)):
        if value:
            params[key] = value
    return {**params, "additional_parameters": extra}


class SweepTask(NamedTuple):
    job: submitit.Job               # `job.results()[0]`: the run's HDF5 path
    output_dir: Path


def submit_sweep(config_path: str, overrides: list[str], sweep: str,
                 check_partitions: bool = True) -> list[SweepTask]:
    """One submitit array task per value of `sweep` (key=v1,v2,...), each run in
    BASE/key=value. `task.job.results()[0]` is the run's HDF5 path (one result per node:
    submitit counts tasks as nodes x 1); `SlurmRun(task.output_dir, task.job.job_id)`
    waits with a timeout and releases requeue holds. Logs: BASE/sweep_logs/."""
    parts = cluster_partitions() if check_partitions else None
    base = prepare(config_path, list(overrides), True, parts).cfg
    variants = sweep_overrides(list(overrides), sweep, base.output_dir)
    plans = [prepare(config_path, ov, True, parts).plan for ov in variants]
    cfgs = [p.cfg for p in plans]
    if len({p.layout.world_size for p in plans}) != 1:
        raise ConfigError(f"--sweep {sweep}: the values change the number of ranks; "
                          "one array needs one shape (submit them separately)")
    for c in cfgs:                      # every task's folder, before any is written
        check_writable(c)
    for c in cfgs:
        (c.output_dir / "logs").mkdir(parents=True, exist_ok=True)
        save_config(c, c.output_dir / "config.yaml")
    ex = submitit.SlurmExecutor(folder=base.output_dir / "sweep_logs", python=shlex.quote(sys.executable))
    ex.update_parameters(**sweep_parameters(plans[0]))
    config_abs = str(Path(config_path).resolve())
    jobs = ex.map_array(SweepRun(), [config_abs] * len(variants), variants)
    for j, c in zip(jobs, cfgs):        # the folder names its job, as submit's do (launch/owner.py)
        (c.output_dir / "logs" / f"{j.job_id}.job").write_text(
            f"array task {j.job_id} of a sweep; its logs: {base.output_dir / 'sweep_logs'}\n")
    return [SweepTask(j, c.output_dir) for j, c in zip(jobs, cfgs)]


# ---------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m flexmarl_hpc.submit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.steps=200")
    ap.add_argument("--dry-run", action="store_true", help="print the job script, submit nothing")
    ap.add_argument("--single", action="store_true", help="one allocation instead of a het job")
    ap.add_argument("--wait", action="store_true", help="wait for the job(s) to end")
    ap.add_argument("--timeout", type=float, default=24 * 3600, help="--wait limit in seconds")
    ap.add_argument("--sweep", help="key=v1,v2,...: a job array, one single-allocation run per value")
    ap.add_argument("--no-partition-check", action="store_true",
                    help="do not compare the slurm: section with what sinfo reports")
    return ap.parse_intermixed_args(argv)   # overrides may follow --dry-run etc.


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    check = not args.no_partition_check
    try:
        if args.dry_run:
            return _dry_run(args, check)
        if args.sweep:
            return _sweep(args, check)
        run = submit(args.config, args.overrides, args.single, check)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError, subprocess.TimeoutExpired, TimeoutError) as e:
        print(f"submit: {e}", file=sys.stderr)
        return 1
    print(f"submitted job {run.job_id}\n"
          f"  log:    {run.paths.stdout}\n  errors: {run.paths.stderr}\n  store:  {run.h5_path}\n"
          f"  watch:  squeue -j {run.job_id}; tail -f {run.paths.stdout}\n"
          f"  cancel: scancel {run.job_id}   checkpoint+requeue: scancel --signal=USR1 {run.job_id}",
          flush=True)
    if not args.wait:
        return 0
    try:
        st = run.wait(args.timeout)
    except TimeoutError as e:
        print(f"submit: {e}", file=sys.stderr)
        return 1
    print(f"job {run.job_id}: {st}" + (f" (requeue holds released: {run.released})" if run.released else ""))
    return 0 if st == "COMPLETED" else 1


def _dry_run(args: argparse.Namespace, check: bool) -> int:
    """Print what would be submitted: the job script (stdout), or a sweep's array parameters."""
    parts = cluster_partitions() if check else None
    if args.sweep:
        base = prepare(args.config, args.overrides, True, parts).cfg
        variants = sweep_overrides(args.overrides, args.sweep, base.output_dir)
        plans = [prepare(args.config, ov, True, parts).plan for ov in variants]
        print(f"# submitit job array of {len(variants)} tasks, logs in {base.output_dir / 'sweep_logs'}")
        print(f"# SlurmExecutor parameters: {sweep_parameters(plans[0])}")
        for ov in variants:
            print(f"# task: python -m flexmarl_hpc.run {shlex.quote(str(Path(args.config).resolve()))} "
                  + " ".join(shlex.quote(o) for o in ov))
    else:
        prep = prepare(args.config, args.overrides, args.single, parts)
        # the component table goes to stderr: `--dry-run > job.sbatch` stays a script
        print(component_table(prep.plan), file=sys.stderr)
        print(prep.script)
    if parts is None and check:
        print("# (no sinfo here: partitions not checked)", file=sys.stderr)
    return 0


def _sweep(args: argparse.Namespace, check: bool) -> int:
    """Submit the sweep's array; with --wait, 0 only if every task completed."""
    tasks = submit_sweep(args.config, args.overrides, args.sweep, check)
    for t in tasks:
        print(f"submitted array task {t.job.job_id}\n  log:    {t.job.paths.stdout}\n"
              f"  output: {t.output_dir}")
    if not args.wait:
        return 0
    deadline, ok = time.monotonic() + args.timeout, True
    for t in tasks:
        st = SlurmRun(t.output_dir, t.job.job_id).wait(max(1.0, deadline - time.monotonic()))
        ok &= st == "COMPLETED"
        print(f"task {t.job.job_id}: {st}: " + (str(t.job.results()[0]) if st == "COMPLETED"
                                                else str(t.job.paths.stderr)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
