"""Slurm: real jobs on a local Slurm cluster (scripts/slurm_up.sh: 8 virtual nodes on this
host, and a `gpu` partition of 48 x 16 GPUs that only `sbatch --test-only` uses). The job
scripts against golden files and the checks before submission: tests/unit/test_slurm_scripts.py.

    pytest tests/slurm/test_slurm.py              # real Slurm; brings the cluster up (root)

Without root or apt the real-Slurm tests skip with the reason; under CI=true they fail.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import h5py
import pytest

from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.submit import SlurmRun, main as submit_main, submit_sweep
from tests.conftest import ROOT, need
from tests.helpers import SMALL_ANY_STEPS as SMALL, wait_for as _wait_for

CONFIG = str(ROOT / "configs/local.yaml")
CONSUMED = 2


def _steps_logged(run: SlurmRun) -> int:
    text = run.paths.stdout.read_text() if run.paths.stdout.exists() else ""
    return max((int(m) for m in re.findall(r"step\s+(\d+)/", text)), default=0)


def assert_store_complete(h5: Path, steps: int) -> None:
    """Every sample consumed exactly once: in /samples/<agent> every row has status 2
    (consumed) and no sample_id repeats; /steps/<agent> has one row per step."""
    with h5py.File(h5, "r") as f:
        agents = list(f.attrs["agents"])
        assert agents == ["speaker", "listener"]
        for agent in agents:
            g = f[f"samples/{agent}"]
            ids = g["sample_id"][:]
            assert len(ids) > 0
            assert len(ids) == len(set(ids.tolist())), f"{agent}: a sample_id appears twice"
            assert (g["status"][:] == CONSUMED).all(), f"{agent}: a sample was not consumed"
            st = f[f"steps/{agent}"]
            assert st["step"].shape[0] == steps, f"{agent}: {st['step'].shape[0]} step rows, want {steps}"
            assert st["step"][:].tolist() == list(range(steps))
    try:                                              # the runtime's deeper check, when present
        from tests.helpers import check_exactly_once
    except ImportError:
        return
    check_exactly_once(h5, steps)


@pytest.mark.slurm
def test_submit_runs_a_het_job_to_completion(slurm, tmp_path, capsys):
    """(c) submit -> one het job of 3 components -> a complete store."""
    assert submit_main([CONFIG, *SMALL, "run.steps=4", f"run.output_dir={tmp_path}",
                        "slurm.sbatch_options=['--comment=flexmarl-test']"]) == 0
    out = capsys.readouterr().out
    job_id = re.search(r"submitted job (\d+)", out).group(1)
    for path in (f"{tmp_path}/logs/{job_id}.out", f"{tmp_path}/logs/{job_id}.err", f"{tmp_path}/local.h5"):
        assert path in out
    run = SlurmRun(tmp_path, job_id)                  # reattach to the id, as a user would
    h5 = run.result(timeout=150)
    assert h5 == tmp_path / "local.h5"
    assert_store_complete(h5, 4)
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "job.sbatch").exists()
    assert f"job {job_id} restart 0" in run.stdout()
    p = subprocess.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State,NNodes"],
                       capture_output=True, text=True, timeout=30)
    comps = {line.split("|")[0]: line.split("|")[1] for line in p.stdout.split()}
    assert comps == {f"{job_id}+{i}": "COMPLETED" for i in range(3)}, p.stdout
    p = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    assert "Comment=flexmarl-test" in p.stdout, p.stdout        # slurm.sbatch_options reached sbatch


@pytest.mark.slurm
@pytest.mark.parametrize("how", ["signal", "preempt"])
def test_interrupted_job_is_requeued_and_finishes_exactly_once(slurm, how, tmp_path):
    """(d) mid-run, the job is signalled (scancel --signal=USR1 --full) or preempted by a
    job in the `high` partition: it checkpoints, exits 75, is requeued, and the requeued
    job (SLURM_RESTART_COUNT=1) finishes the run with every sample consumed exactly once."""
    if how == "preempt":
        need("high" in slurm, "a `high` partition that preempts the default one (scripts/slurm_up.sh)")
    steps = 300                                       # ~40 ms each: the signal lands mid-run
    run = submit_from_test(tmp_path, steps)
    _wait_for(lambda: _steps_logged(run) >= 3, 120, "3 steps")
    if how == "signal":
        run.signal("USR1", full=True)                 # the batch shell traps it; the ranks act
    else:
        # every CPU of every node: Slurm must preempt (SIGTERM, GraceTime 30 s, requeue)
        nodes = subprocess.run(["sinfo", "-h", "-p", "high", "-o", "%D"], capture_output=True, text=True,
                               timeout=20).stdout.split()[0]
        p = subprocess.run(["sbatch", "--parsable", "-p", "high", "-N", nodes, "--exclusive", "-o", "/dev/null",
                            "--wrap", "sleep 1"], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, p.stderr
    _wait_for(lambda: "ranks exited 75" in run.stdout(), 90, "the checkpoint and exit 75")
    h5 = run.result(timeout=180)                      # wait() releases the requeue hold
    log = run.stdout()
    assert f"job {run.job_id} restart 1" in log and "resumed at versions" in log, log[-3000:]
    assert _steps_logged(run) == steps
    assert_store_complete(h5, steps)


@pytest.mark.slurm
def test_sweep_runs_one_array_task_per_value(slurm, tmp_path):
    """--sweep trainer.lr=1e-3,3e-4: one submitit job array, each task one allocation
    running its own value into BASE/key=value to a complete store."""
    tasks = submit_sweep(CONFIG, [*SMALL, "run.steps=2", f"run.output_dir={tmp_path}"], "trainer.lr=1e-3,3e-4")
    assert [t.output_dir for t in tasks] == [tmp_path / "trainer.lr=1e-3", tmp_path / "trainer.lr=3e-4"]
    assert len({t.job.job_id.split("_")[0] for t in tasks}) == 1       # one array
    for task, lr in zip(tasks, (1e-3, 3e-4)):
        state = SlurmRun(task.output_dir, task.job.job_id).wait(timeout=180)
        assert state == "COMPLETED", task.job.paths.stderr.read_text()[-3000:]
        h5 = task.output_dir / "local.h5"
        assert Path(task.job.results()[0]) == h5
        assert_store_complete(h5, 2)
        assert load_config(str(task.output_dir / "config.yaml")).trainer.lr == lr


@pytest.mark.slurm
def test_signalled_sweep_task_requeues_and_resumes(slurm, tmp_path):
    """A sweep task signalled mid-run (USR2, submitit's preemption signal) checkpoints,
    requeues itself and resumes from its output_dir to a complete store."""
    steps = 300                                       # ~40 ms each: the signal lands mid-run
    (task,) = submit_sweep(CONFIG, [*SMALL, f"run.steps={steps}", f"run.output_dir={tmp_path}"], "trainer.lr=1e-3")
    log = task.job.paths.stdout
    _wait_for(lambda: log.exists() and re.search(r"step\s+3/", log.read_text()), 120, "3 steps")
    p = subprocess.run(["scancel", "--signal=USR2", task.job.job_id], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert SlurmRun(task.output_dir, task.job.job_id).wait(timeout=240) == "COMPLETED"
    text = log.read_text()
    assert "preemption signal" in text and "resumed at versions" in text, text[-3000:]
    assert_store_complete(task.output_dir / "local.h5", steps)


def submit_from_test(tmp_path: Path, steps: int) -> SlurmRun:
    from flexmarl_hpc.submit import submit
    return submit(CONFIG, [*SMALL, f"run.steps={steps}", f"run.output_dir={tmp_path}"])



@pytest.mark.slurm
def test_sbatch_templates_run_as_written(slurm, tmp_path):
    """slurm/*.sbatch, submitted with plain sbatch (only the output folder and the venv
    path moved to tmp), run a short training to a complete store."""
    runs = []
    for name in ("flexmarl_hetjob.sbatch", "flexmarl_single.sbatch"):
        out = tmp_path / name.split(".")[0]
        (out / "logs").mkdir(parents=True)
        text = (ROOT / "slurm" / name).read_text().replace("runs/flexmarl", str(out)).replace(
            "source .venv/bin/activate", f"source {ROOT}/.venv/bin/activate")
        (out / name).write_text(text)
        env = {**os.environ, "CONFIG": CONFIG, "EXTRA": " ".join([*SMALL, "run.steps=2"])}
        p = subprocess.run(["sbatch", "--parsable", str(out / name)], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        runs.append(SlurmRun(out, p.stdout.strip().split(";")[0], out / "local.h5"))
    for run in runs:
        assert_store_complete(run.result(timeout=150), 2)
    assert "--het-group" in (ROOT / "slurm/flexmarl_hetjob.sbatch").read_text()


# ---------------------------------------------------------------------------------------
# (e) heterogeneous agents: the paper's 48 x 16 GPU job, judged by a real slurmctld
# ---------------------------------------------------------------------------------------
PAPER = str(ROOT / "configs/paper_3x32b_7x14b.yaml")


@pytest.mark.slurm
def test_paper_config_is_accepted_by_sbatch_test_only(slurm, tmp_path, capsys):
    """configs/paper_3x32b_7x14b.yaml (13 components, 561 ranks, 752 GPUs on 48 nodes x 16 GPUs)
    as `submit` writes it: slurmctld's own scheduler says when it would start (the local
    cluster's `gpu` partition: 48 State=CLOUD nodes with Gres=gpu:16, scripts/slurm_up.sh).
    The same script asking one GPU too many per replica is refused: the test can fail."""
    need("gpu" in slurm, "a Slurm partition `gpu` of 48 nodes x 16 GPUs (scripts/slurm_up.sh)")
    ov = [f"run.output_dir={tmp_path}"]
    assert submit_main([PAPER, *ov, "--dry-run"]) == 0      # partitions checked against sinfo
    out = capsys.readouterr()
    assert "total           561      48     752" in out.err
    script = tmp_path / "job.sbatch"
    script.write_text(out.out)
    assert out.out.count("#SBATCH hetjob") == 12
    p = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "to start at" in p.stderr, p.stderr
    bad = tmp_path / "bad.sbatch"
    bad.write_text(out.out.replace("--gpus-per-task=4", "--gpus-per-task=5"))
    p = subprocess.run(["sbatch", "--test-only", str(bad)], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "not available" in p.stderr, p.stderr


HETERO = str(ROOT / "configs/hetero_cpu.yaml")


@pytest.mark.slurm
def test_hetero_cpu_runs_as_a_six_component_het_job(slurm, tmp_path):
    """configs/hetero_cpu.yaml on the local Slurm: 6 components (orchestrator, 2 pools, 3
    trainer groups, one of them megatron TP 2), every sample trained exactly once."""
    from flexmarl_hpc.config.load import load_config
    from tests.helpers import check_exactly_once, check_group_intervals
    ov = ["run.steps=4", f"run.output_dir={tmp_path}", "run.log_every=1"]
    cfg = load_config(HETERO, ov)
    assert submit_main([HETERO, *ov, "--wait", "--timeout", "900"]) == 0
    script = next((tmp_path / "logs").glob("*.sbatch")).read_text()
    assert script.count("#SBATCH hetjob") == 5
    h5 = tmp_path / "hetero_cpu.h5"
    check_exactly_once(h5, 4)
    check_group_intervals(h5, cfg)
