"""Two runs on one run.output_dir: the second is refused before any rank starts (exit 2, one
line naming the first's host and PID) and changes nothing; the first ends as if it had run
alone (the same store content and final weights as a run of the same seed in another folder)."""
from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np

from flexmarl_hpc.store.lock import LOCK_NAME
from tests.conftest import ROOT, run_training
from tests.helpers import check_exactly_once, final_weights

STEPS = 60
ARGS = [f"run.steps={STEPS}", "run.log_every=1"]
# the columns a seeded run determines (not its times), as in the kill tests' fingerprints
COLUMNS = ("sample_id", "parent_id", "input_id", "turn", "traj", "step", "policy_version", "status",
           "reward", "advantage", "trainer_step", "token_offset", "prompt_len", "response_len")


def fingerprint(out: Path) -> dict[str, str]:
    """sha256 of the store's deterministic /samples columns and /tokens pools, and of each
    agent's final checkpoint's `model.*` tensors."""
    with h5py.File(out / "local.h5", "r") as f:
        hs = hashlib.sha256()
        agents = [str(a) for a in f.attrs["agents"]]
        for agent in sorted(agents):
            s = f["samples"][agent][...]
            for col in COLUMNS:
                hs.update(np.ascontiguousarray(s[col]).tobytes())
            hs.update(np.ascontiguousarray(f["tokens"][agent][...]).tobytes())
    prints = {"samples+tokens": hs.hexdigest()[:16]}
    for agent in agents:
        sd = final_weights(out, agent)
        model = {k: v for k, v in sd.items() if k.startswith("model.")} or sd["model"]
        hw = hashlib.sha256()
        for k in sorted(model):
            hw.update(k.encode())
            hw.update(model[k].float().numpy().tobytes())
        prints[f"weights {agent}"] = hw.hexdigest()[:16]
    return prints


def start_run(out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "flexmarl_hpc.run", "configs/local.yaml", f"run.output_dir={out}", *ARGS]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_for_steps(out: Path, a: subprocess.Popen, n: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert a.poll() is None, f"run A ended early (rc {a.returncode}): {a.stdout.read()[-3000:]}"
        log = out / "train.log"
        if log.exists() and sum(line.startswith("step ") for line in log.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"run A logged fewer than {n} steps in {timeout} s")


def test_second_run_refused_first_untouched(tmp_path, mpiexec):
    out = tmp_path / "shared"
    a = start_run(out)
    try:
        wait_for_steps(out, a, 3)
        config_before = (out / "config.yaml").read_bytes()
        b = run_training(out, *ARGS, check=False, timeout=120)
        # as srun starts the ranks of a resubmitted Slurm job: no launcher, rank 0's own lock refuses
        srun_like = subprocess.run([mpiexec, "-n", "4", sys.executable, "-m", "flexmarl_hpc.run",
                                    "configs/local.yaml", f"run.output_dir={out}", *ARGS], cwd=ROOT,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                                   text=True, timeout=120)
        assert a.poll() is None, "run A ended before B was refused: the test proves nothing (raise STEPS)"
        named = b.stderr.split(", PID ")[1].split(",")[0] if ", PID " in b.stderr else "?"
        # the PID B names is A's orchestrator (rank 0), alive, running on this folder
        cmdline = Path(f"/proc/{named}/cmdline").read_bytes().split(b"\0") if named.isdigit() else []
        a_out, _ = a.communicate(timeout=300)
    finally:
        if a.poll() is None:
            a.kill()
    assert b.returncode == 2, f"B: rc {b.returncode}\n{b.stdout[-2000:]}\n{b.stderr[-2000:]}"
    assert b.stdout == "", "B must not launch"
    lines = b.stderr.splitlines()
    assert len(lines) == 1, b.stderr
    assert lines[0].startswith(f"config error: run.output_dir: {out} is in use by another run (host "
                               f"{socket.gethostname()}, PID "), lines[0]
    assert srun_like.returncode == 2, srun_like.stderr[-3000:]
    assert srun_like.stdout == "" and srun_like.stderr.splitlines() == lines, srun_like.stderr[-3000:]
    assert b"flexmarl_hpc.run" in cmdline and f"run.output_dir={out}".encode() in cmdline, cmdline
    assert a.returncode == 0, a_out[-3000:]
    # B changed nothing: A's config, one header in train.log, the lock released by A at its end
    assert (out / "config.yaml").read_bytes() == config_before
    assert (out / "train.log").read_text().count("local: mode flex") == 1
    assert (out / LOCK_NAME).read_bytes() == b""
    check_exactly_once(out / "local.h5", STEPS)
    # ... and A's store and weights are those of the same run alone
    alone = tmp_path / "alone"
    run_training(alone, *ARGS)
    shared, solo = fingerprint(out), fingerprint(alone)
    print(f"\nfingerprints with a refused second run: {shared}\nfingerprints of the run alone: {solo}")
    assert shared == solo


def test_late_concurrent_starts_are_refused_by_their_own_launcher_before_any_rank_starts(tmp_path, mpiexec):
    """Issue 38: a second run started 0-1.5 s after the first passed the launcher's lock probe
    (the first's rank 0 had not locked yet) and started 4 ranks, refused 10-18 s later. The
    launcher now takes the lock itself and hands it to mpiexec: of runs started 0, 0.5 and
    1.5 s after a first one on the same folder, exactly one launches and every other is
    refused by its own launcher (rc 2, one line, nothing launched). 2 rounds; the refusal
    times are printed (median [min, max]), the order is what is asserted."""
    from statistics import median
    from tests.helpers import sigkill_tree
    waits = []
    for rnd in range(2):
        out = tmp_path / f"round{rnd}"
        out.mkdir()                                        # the same folder again (a resume, a rerun)
        runs, t_prev = [], 0.0
        for offset in (0.0, 0.0, 0.5, 1.5):                # the first, then the late ones
            time.sleep(offset - t_prev)
            t_prev = offset
            cmd = [sys.executable, "-m", "flexmarl_hpc.run", "configs/local.yaml", f"run.output_dir={out}",
                   "run.steps=3", "run.eval_every=0"]
            runs.append((time.monotonic(), subprocess.Popen(
                cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
        try:
            ended, deadline = {}, time.monotonic() + 60
            while len(ended) < 3 and time.monotonic() < deadline:
                for i, (t0, p) in enumerate(runs):
                    if i not in ended and p.poll() is not None:
                        ended[i] = (time.monotonic() - t0, p.returncode, *p.communicate())
                time.sleep(0.02)
            ended = list(ended.values())
        finally:
            for _, p in runs:
                if p.poll() is None:
                    sigkill_tree(p)
        assert len(ended) == 3, [(rc, e) for _, rc, _, e in ended]
        for secs, rc, o, e in ended:
            assert rc == 2 and "launching" not in o, (rc, o, e)
            assert e.startswith(f"config error: run.output_dir: {out} is in use by another run") \
                and e.count("\n") == 1, e
            waits.append(secs)
    print(f"\nrefused after {median(waits):.2f} s [{min(waits):.2f}, {max(waits):.2f}] (median [min, max] "
          f"of {len(waits)} late starts)")
