"""Submit a run to Slurm from a login node, as one heterogeneous job.

    python -m flexmarl_hpc.submit configs/local.yaml run.steps=200          # submit, print paths
    python -m flexmarl_hpc.submit configs/local.yaml --dry-run              # print the script only
    python -m flexmarl_hpc.submit configs/local.yaml --single               # one allocation instead
    python -m flexmarl_hpc.submit configs/local.yaml --wait                 # block until it ends
    python -m flexmarl_hpc.submit configs/local.yaml --sweep trainer.lr=1e-3,3e-4   # one job per value

The config is validated (and the `slurm:` section checked) before anything is submitted;
the resolved config and the job script are written to run.output_dir, the logs go to
run.output_dir/logs/<jobid>.out|err. From Python, `submit(cfg, ...)` returns a `JobHandle`
that behaves like a Future (`state`, `done()`, `wait()`, `result()`, `cancel()`).

submitit's job watcher does not know het jobs (sacct lists them as `ID+0`, `ID+1`...;
submitit reports UNKNOWN, its issue 1741), so JobHandle reads sacct/squeue itself.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .config import Config, ConfigError, load_config, save_config
from .slurm import hetjob_script, single_script

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
            "BOOT_FAIL", "DEADLINE"}


@dataclass
class JobHandle:
    """A submitted run; Future-like. States come from sacct (squeue while it has none)."""
    job_id: str
    output_dir: Path
    h5_path: Path

    @property
    def stdout(self) -> Path:
        return self.output_dir / "logs" / f"{self.job_id}.out"

    @property
    def stderr(self) -> Path:
        return self.output_dir / "logs" / f"{self.job_id}.err"

    @property
    def state(self) -> str:
        p = subprocess.run(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", self.job_id],
                           capture_output=True, text=True, timeout=30)
        for line in p.stdout.splitlines():
            jid, _, st = line.partition("|")
            if jid in (self.job_id, f"{self.job_id}+0"):
                return st.split()[0] if st else "UNKNOWN"
        q = subprocess.run(["squeue", "-h", "-o", "%T", "-j", self.job_id],
                           capture_output=True, text=True, timeout=30)
        return q.stdout.split()[0] if q.stdout.split() else "UNKNOWN"

    def done(self) -> bool:
        return self.state in TERMINAL

    def wait(self, timeout: float = 3600, poll: float = 2.0) -> str:
        """Block until the job reaches a terminal state; returns it. TimeoutError after `timeout`."""
        t0 = time.monotonic()
        while True:
            st = self.state
            if st in TERMINAL:
                return st
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"job {self.job_id} still {st} after {timeout} s")
            time.sleep(poll)

    def result(self, timeout: float = 3600) -> Path:
        """The run's HDF5 file once the job completed; RuntimeError (with the log tail) otherwise."""
        st = self.wait(timeout)
        if st != "COMPLETED":
            tail = self.stderr.read_text()[-2000:] if self.stderr.exists() else ""
            raise RuntimeError(f"job {self.job_id} ended {st}; {self.stderr}:\n{tail}")
        return self.h5_path

    def cancel(self) -> None:
        subprocess.run(["scancel", self.job_id], check=True, timeout=30)

    def signal(self, sig: str = "USR1") -> None:
        """Send a signal to every task (what `--signal=USR1@N` does before the time limit)."""
        subprocess.run(["scancel", f"--signal={sig}", self.job_id], check=True, timeout=30)


def prepare(config_path: str, overrides: list[str], single: bool = False) -> tuple[Config, str, list[str]]:
    """Validate, make output_dir absolute, write config + script. Returns (cfg, script, overrides)."""
    cfg = load_config(config_path, overrides)
    out = cfg.output_dir.resolve()
    overrides = [o for o in overrides if not o.startswith("run.output_dir=")] + [f"run.output_dir={out}"]
    cfg = load_config(config_path, overrides)
    make = single_script if single else hetjob_script
    script = make(cfg, str(Path(config_path).resolve()), overrides, python=sys.executable)
    return cfg, script, overrides


def submit(config_path: str, overrides: list[str] = (), single: bool = False) -> JobHandle:
    cfg, script, _ = prepare(config_path, list(overrides), single)
    out = cfg.output_dir
    (out / "logs").mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    path = out / "job.sbatch"
    path.write_text(script)
    p = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise RuntimeError(f"sbatch refused {path}: {p.stderr.strip()}")
    job_id = p.stdout.strip().split(";")[0]
    return JobHandle(job_id, out, out / f"{cfg.run.name}.h5")


def sweep_overrides(overrides: list[str], sweep: str | None) -> list[list[str]]:
    """`key=v1,v2` -> one override list per value, each with its own run.name suffix."""
    if not sweep:
        return [overrides]
    key, _, values = sweep.partition("=")
    if not key or not values:
        raise ConfigError(f"--sweep {sweep!r}: expected key=v1,v2,...")
    name = next((o.split("=", 1)[1] for o in overrides if o.startswith("run.name=")), None)
    out = []
    for i, v in enumerate(values.split(",")):
        base = [o for o in overrides if not o.startswith(("run.name=", "run.output_dir="))]
        suffix = f"{key.split('.')[-1]}{v}"
        out.append(base + [f"{key}={v}"] + ([f"run.name={name}-{suffix}"] if name else
                                             [f"run.output_dir=runs/sweep-{suffix}"]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flexmarl_hpc.submit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--dry-run", action="store_true", help="print the job script, submit nothing")
    ap.add_argument("--single", action="store_true", help="one allocation instead of a het job")
    ap.add_argument("--wait", action="store_true", help="wait for the job(s) to end")
    ap.add_argument("--sweep", help="key=v1,v2,...: one job per value")
    a = ap.parse_args(argv)
    try:
        variants = sweep_overrides(a.overrides, a.sweep)
        if a.dry_run:
            for ov in variants:
                print(prepare(a.config, ov, a.single)[1])
            return 0
        jobs = [submit(a.config, ov, a.single) for ov in variants]
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, FileNotFoundError) as e:
        print(f"submit: {e}", file=sys.stderr)
        return 1
    for j in jobs:
        print(f"submitted job {j.job_id}\n  log:    {j.stdout}\n  errors: {j.stderr}\n  store:  {j.h5_path}\n"
              f"  watch:  squeue -j {j.job_id}; tail -f {j.stdout}\n  cancel: scancel {j.job_id}")
    if a.wait:
        states = [j.wait() for j in jobs]
        for j, st in zip(jobs, states):
            print(f"job {j.job_id}: {st}")
        return 0 if all(s == "COMPLETED" for s in states) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
