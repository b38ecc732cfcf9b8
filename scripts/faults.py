"""Fault-injection harness: SIGKILL one rank of a real run, re-run the same command, check the file.

    PYTHONPATH=$PWD .venv/bin/python scripts/faults.py --kills 24 --hooked 8 --at-step --seed 3 \
        --jobs 2 --run-s 1 --out runs/faults  # 8 hooked kills, 16 at seeded steps (the README's table)
    PYTHONPATH=$PWD .venv/bin/python scripts/faults.py --kills 24 --seed 0 --jobs 3 --run-s 80 \
        --out runs/faults_t                  # random kills at seeded times after launch

Each trial runs the default training command on a small config (`TRAIN_ARGS`: configs/local.yaml,
30 steps, a checkpoint every 5, trainer.ranks_per_group=2 so every group has a leader and a
member) into `<out>/fault_<n>` and kills ONE rank with SIGKILL:

- at a seeded random moment: the orchestrator (world rank 0), the replica (1), a trainer
  leader (2 or 4) or a trainer member (3 or 5), found by its launcher's rank variable (`PMI_RANK`, `PMIX_RANK`, ...) in /proc/<pid>/environ;
- or precisely, through the test-only hook `flexmarl_hpc/faults.py` (env FLEXMARL_FAULT):
  mid checkpoint file (`checkpoint_write`), between its rename and its manifest
  (`checkpoint_latest`), after a table's rows are written but before /commit
  (`store_append`), after the HDF5 flush but before /commit (`store_flush`), or with a
  chunk rewritten as a kill inside its in-place write leaves it (`store_torn`).

It measures the seconds until mpiexec has taken every rank down (past `--bound` it kills the
process group and records a hang), re-runs the SAME command (no extra flags, no hook) until
it exits 0, and checks the HDF5 file with `check_store`, a reader that uses only h5py and
the README's schema (not flexmarl_hpc): every step 0..N-1 of every agent once among the
current /steps rows with its full batch, every sample trained exactly once, statuses equal to
the last committed /events entry. It prints one table row per kill (the README's Reliability
section shows one). Exit code 1 when any kill lost, duplicated or stranded a sample.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import h5py
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from flexmarl_hpc.faults import launcher_rank  # noqa: E402  (one list of the launchers' rank variables)

STEPS, EVERY = 30, 5
TRAIN_ARGS = ["configs/local.yaml", f"run.steps={STEPS}", f"run.checkpoint_every={EVERY}",
              "trainer.ranks_per_group=2", "run.log_every=1", "workflow.inputs_per_step=4",
              "trainer.micro_batch_size=8", "model.hidden_size=32", "model.intermediate_size=64"]
ROLES = {"orchestrator": [0], "replica": [1], "trainer leader": [2, 4], "trainer member": [3, 5]}
HOOKS = {"checkpoint_write": ROLES["trainer leader"], "checkpoint_latest": ROLES["trainer leader"],
         "store_append": [0], "store_flush": [0], "store_torn": [0]}
CONSUMED = 2


def command(out: Path) -> list[str]:
    return [sys.executable, "-m", "flexmarl_hpc.run", *TRAIN_ARGS, f"run.output_dir={out}"]


def rank_pids(tag: str, cmd_has: str = "") -> dict[int, int]:
    """World rank -> pid of this trial's live ranks (their environ carries our tag; their
    command line `cmd_has`, where a shell wraps them: tests/mpi/test_dead_rank.py)."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv)
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = (d / "cmdline").read_text()
        except (OSError, ValueError):
            continue
        rank = launcher_rank(env)
        if env.get("FLEXMARL_FAULT_TAG") == tag and rank is not None and state != "Z" and cmd_has in cmd:
            found[rank] = int(d.name)
    return found


def last_step(log: Path) -> str:
    lines = [l for l in log.read_text().splitlines() if l.startswith("step")] if log.exists() else []
    return lines[-1].split("|")[0].split()[1] if lines else "none"


def kill_trial(out: Path, rank: int, hook: str | None, count: int, delay: float, bound: float) -> dict:
    """Start the run, kill `rank` (by the hook, or `delay` s after launch or, with no hook and
    `count` > 0, after step `count` is logged), time the teardown."""
    at_step = 0 if hook else count
    tag = out.name
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLEXMARL_FAULT_TAG": tag}
    if hook:
        env["FLEXMARL_FAULT"] = f"{hook}:{count}:{rank}"
    p = subprocess.Popen(command(out), cwd=ROOT, env=env, stdout=open(out / "killed.out", "w"),
                         stderr=subprocess.STDOUT, start_new_session=True)
    t_start, pids = time.time(), {}
    while len(pids) < 6 and p.poll() is None:              # 6 ranks: 1 + 1 + 2 groups x 2
        time.sleep(0.2)
        pids = rank_pids(tag)
    row = {"moment": "", "hang": False}
    if hook:
        while rank in rank_pids(tag) and p.poll() is None:
            time.sleep(0.05)
        t_kill = time.time()
        row["moment"] = f"{hook} #{count} (step {last_step(out / 'train.log')})"
    else:
        if at_step:                       # load-proof: wait for that step, then the delay
            while int(last_step(out / "train.log").split("/")[0].replace("none", "0")) < at_step \
                    and p.poll() is None:
                time.sleep(0.05)
        time.sleep(delay)
        t_kill = time.time()
        after = f"step {at_step} logged" if at_step else "launch"
        row["moment"] = f"{delay:.1f}s after {after} (step {last_step(out / 'train.log')})"
        try:
            os.kill(pids[rank], signal.SIGKILL)
            row["killed"] = True
        except (KeyError, ProcessLookupError):
            row["killed"] = False
    while rank_pids(tag) and time.time() - t_kill < bound:
        time.sleep(0.05)
    row["gone_s"] = time.time() - t_kill
    if rank_pids(tag):
        row["hang"] = True
        os.killpg(p.pid, signal.SIGKILL)
    try:
        p.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        row["hang"] = True
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    row["rc"] = p.returncode
    if hook:
        row["killed"] = p.returncode != 0          # 0: the run ended before the count was reached
    return row


def resume(out: Path, tries: int, timeout: float) -> tuple[int, str]:
    """Re-run the same command until it exits 0; returns (attempts, last error line)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("FLEXMARL_FAULT", None)
    err = ""
    for i in range(1, tries + 1):
        q = subprocess.run(command(out), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        (out / f"resume{i}.out").write_text(q.stdout + q.stderr)
        if q.returncode == 0:
            return i, err
        err = f"rc {q.returncode}: " + next((l for l in reversed((q.stdout + q.stderr).splitlines())
                                              if "Error" in l or "error" in l), "?")
    return 0, err


def check_store(path: Path) -> dict:
    """h5py and the README's schema only. Per agent: the current (/steps superseded == 0) rows
    are steps 0..N-1 once each with n_samples = the agent's global batch; every sample row in
    them appears once (trained twice otherwise), each step's batch is complete (lost otherwise);
    the status of every sample is its last committed event's, consumed iff in a current step."""
    res = {"lost": 0, "twice": 0, "status_errors": 0, "problems": []}
    with h5py.File(path, "r") as f:
        cfg = yaml.safe_load(f.attrs["config_yaml"])
        commit = dict(zip([t.decode() if isinstance(t, bytes) else t for t in f["commit"].attrs["tables"]],
                          f["commit"][:]))
        steps = cfg["run"]["steps"]
        agents = [a.decode() if isinstance(a, bytes) else a for a in f.attrs["agents"]]
        ev = f["events"][:commit["/events"]]
        batch = cfg["workflow"]["inputs_per_step"]
        for i, agent in enumerate(agents):
            batch *= next(t["samples"] for t in cfg["workflow"]["turns"] if t["agent"] == agent)
            samples = f[f"samples/{agent}"][:commit[f"/samples/{agent}"]]
            st = f[f"steps/{agent}"][:commit[f"/steps/{agent}"]]
            pool = f[f"step_rows/{agent}"][:commit[f"/step_rows/{agent}"]]
            cur = st[st["superseded"] == 0]
            seen = Counter(cur["step"].tolist())
            missing = [s for s in range(steps) if seen[s] == 0]
            extra = {s: n for s, n in seen.items() if n > 1 or not 0 <= s < steps}
            if missing or extra:
                res["problems"].append(f"{agent}: steps missing {missing}, repeated/out of range {extra}")
            trained = Counter()
            for s, off, n, ns in zip(cur["step"], cur["rows_offset"], cur["rows_len"], cur["n_samples"]):
                rows = pool[off:off + n]
                if ns != batch or n != batch:
                    res["problems"].append(f"{agent} step {s}: n_samples {ns}, rows {n}, batch {batch}")
                if (samples["step"][rows] != s).any():
                    res["problems"].append(f"{agent} step {s}: trained samples of another step")
                trained.update(samples["sample_id"][rows].tolist())
            res["twice"] += sum(n - 1 for n in trained.values() if n > 1)
            res["lost"] += steps * batch - len(trained)          # a missing step loses its batch
            dup = [k for k, n in Counter(samples["sample_id"].tolist()).items() if n > 1]
            if dup:
                res["problems"].append(f"{agent}: {len(dup)} sample ids generated twice")
            mine = ev[ev["agent"] == i]
            last = {}
            for row, status in zip(mine["row"], mine["status"]):
                last[int(row)] = int(status)
            ids = samples["sample_id"]
            in_step = np.isin(ids, list(trained))
            for r in range(len(samples)):
                want = last.get(r, 0)
                consumed = samples["status"][r] == CONSUMED
                if samples["status"][r] != want or consumed != in_step[r]:
                    res["status_errors"] += 1
    return res


def plan(kills: int, seed: int, run_s: float, hooked_max: int = 8, at_step: bool = False) -> list[tuple]:
    """(fault, rank, hook, count, delay): each hooked moment twice (a third of the kills and
    `hooked_max` at most), then random-time kills cycling over the four roles; ranks, counts and delays drawn
    from `seed`. Counts stay below what a run reaches (5 checkpoints per leader, ~400 flushes)."""
    rng = random.Random(seed)
    hooked = [("trainer leader", "checkpoint_write", 5), ("trainer leader", "checkpoint_latest", 5),
              ("orchestrator", "store_append", 400), ("orchestrator", "store_flush", 200),
              ("orchestrator", "store_torn", 400)]
    out = [(role, rng.choice(HOOKS[hook]), hook, rng.randint(1, most), 0)
           for _ in range(2) for role, hook, most in hooked][:min(hooked_max, max(4, kills // 3))]
    roles = list(ROLES)
    while len(out) < kills:
        role = roles[len(out) % len(roles)]
        if at_step:                   # a seeded step, then up to a second into the next one
            rank = rng.choice(ROLES[role])
            out.append((role, rank, None, rng.randint(1, STEPS - 1), round(rng.uniform(0, 1), 2)))
        else:
            out.append((role, rng.choice(ROLES[role]), None, 0, round(rng.uniform(0.1, 0.9) * run_s, 1)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "faults")
    ap.add_argument("--run-s", type=float, default=0, help="a clean run's seconds (0: measure it)")
    ap.add_argument("--bound", type=float, default=60, help="seconds a rank may outlive a kill")
    ap.add_argument("--hooked", type=int, default=8, help="hooked kills at most (0: random only)")
    ap.add_argument("--at-step", action="store_true", help="random kills at a seeded step, not time")
    ap.add_argument("--jobs", type=int, default=1, help="trials run at once (each starts 6 ranks)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one resume may take")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run_s = args.run_s
    if not run_s:                               # random delays span a clean run's duration
        t0 = time.time()
        subprocess.run(command(args.out / "clean"), cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, check=True, timeout=args.timeout)
        run_s = time.time() - t0
        print(f"clean run: {run_s:.1f}s", flush=True)
    print("| # | fault | moment | exit code | s until all ranks gone | resumed | samples lost "
          "| trained twice | notes |\n" + "|---" * 9 + "|", flush=True)
    with ThreadPoolExecutor(args.jobs) as pool:    # trials share nothing but the machine
        trials = enumerate(plan(args.kills, args.seed, run_s, args.hooked, args.at_step))
        results = pool.map(lambda t: trial(args, *t), trials)
        return 1 if sum(report(*r) for r in results) else 0


def trial(args, n: int, plan_row: tuple) -> tuple:
    role, rank, hook, count, delay = plan_row
    out = args.out / f"fault_{n}"
    out.mkdir(parents=True, exist_ok=False)
    try:
        row = kill_trial(out, rank, hook, count, delay, args.bound)
        tries, err = resume(out, 3, args.timeout)
    except Exception as e:                          # a harness failure is a row, not the end
        row = {"moment": "?", "hang": False, "killed": False, "rc": "?", "gone_s": float("nan")}
        tries, err = 0, repr(e)
    chk = check_store(out / "local.h5") if tries else {"lost": "?", "twice": "?", "status_errors": 0,
                                                      "problems": []}
    return n, role, rank, row, tries, err, chk


def report(n, role, rank, row, tries, err, chk) -> bool:
    """Print a trial's table row; True when it found a failure."""
    notes = [s for s in (
        "HANG: process group killed" if row["hang"] else "",
        "" if row["killed"] else "run ended before the kill",
        f"{tries} re-runs" if tries > 1 else "", err,
        f"{chk['status_errors']} status errors" if chk["status_errors"] else "",
        *chk["problems"][:3]) if s]
    bad = bool(row["hang"] or not tries or chk["lost"] or chk["twice"] or chk["status_errors"]
               or chk["problems"])
    print(f"| {n} | {role} (rank {rank}) | {row['moment']} | {row['rc']} | {row['gone_s']:.1f} | "
          f"{'yes' if tries else 'no'} | {chk['lost']} | {chk['twice']} | {'; '.join(notes)} |", flush=True)
    return bad


if __name__ == "__main__":
    sys.exit(main())
