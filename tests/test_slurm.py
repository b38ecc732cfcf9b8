"""Slurm: job scripts against golden files, config checks, and real jobs on a local Slurm
cluster (scripts/slurm_up.sh: 4 virtual nodes on this host)."""
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from flexmarl_hpc.config import ConfigError, load_config
from flexmarl_hpc.slurm import hetjob_script, single_script
from flexmarl_hpc.submit import JobHandle, main as submit_main, prepare, submit
from tests.conftest import IN_CI, ROOT, need
from tests.test_run import check_exactly_once

GOLDEN = Path(__file__).parent / "golden"
SITE = ["run.output_dir=/scratch/flexmarl/{name}", "rollout.replicas=3", "trainer.ranks_per_group=2",
        "slurm.partition=gpu", "slurm.account=proj42", "slurm.qos=normal", "slurm.time=02:00:00",
        "slurm.mpi=pmix", "slurm.rollout={nodes: 3, gpus_per_node: 1, cpus_per_task: 8, mem: 64G}",
        "slurm.trainer={nodes: 2, gpus_per_node: 2, cpus_per_task: 8, mem: 128G, partition: gpu-large}",
        "slurm.setup=['module load cuda/12.4', 'source /opt/flexmarl/venv/bin/activate']"]
SMALL = ["workflow.inputs_per_step=4", "trainer.micro_batch_size=8", "model.hidden_size=32",
         "model.intermediate_size=64", "run.log_every=1"]


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; UPDATE_GOLDEN=1 rewrites it after review"


def test_hetjob_script_matches_golden():
    cfg = load_config(ROOT / "configs/local.yaml", SITE)
    text = hetjob_script(cfg, "configs/local.yaml", SITE, python="python")
    golden("hetjob_local.sbatch", text)
    assert text.count("#SBATCH hetjob") == 2
    assert "--ntasks=1" in text and "--ntasks=3" in text and "--ntasks=4" in text


def test_single_allocation_script_matches_golden():
    cfg = load_config(ROOT / "configs/local.yaml", SITE)
    golden("single_local.sbatch", single_script(cfg, "configs/local.yaml", SITE, python="python"))


@pytest.mark.parametrize("override, field", [
    ("slurm.time=1h", "slurm.time"),
    ("slurm.mpi=openmpi", "slurm.mpi"),
    ("slurm.rollout={nodes: 0}", "slurm.rollout.nodes"),
    ("slurm.rollout={nodes: 5}", "slurm.rollout.nodes"),
    ("slurm.trainer={gpus_per_node: -1}", "slurm.trainer.gpus_per_node"),
    ("slurm.trainer={mem: lots}", "slurm.trainer.mem"),
    ("slurm.trainer={gpus: 4}", "slurm.trainer.gpus"),
])
def test_bad_slurm_section_is_refused_before_submission(override, field, tmp_path, capsys):
    with pytest.raises(ConfigError, match=f"^{field}"):
        prepare(str(ROOT / "configs/local.yaml"), [override, f"run.output_dir={tmp_path}"])
    assert submit_main([str(ROOT / "configs/local.yaml"), override, f"run.output_dir={tmp_path}"]) == 2
    assert field in capsys.readouterr().err
    assert not (tmp_path / "job.sbatch").exists()


def test_dry_run_prints_the_script(tmp_path, capsys):
    assert submit_main([str(ROOT / "configs/local.yaml"), f"run.output_dir={tmp_path}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash") and "srun --mpi=pmi2 --het-group=0-2" in out
    assert f"run.output_dir={tmp_path}" in out


# ---------------------------------------------------------------------------------------
# real Slurm
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def slurm():
    if shutil.which("sinfo") is None or subprocess.run(["sinfo"], capture_output=True).returncode != 0:
        need(os.geteuid() == 0, "a local Slurm cluster (root needed to bring it up)")
        p = subprocess.run(["bash", "scripts/slurm_up.sh"], cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
        need(p.returncode == 0, f"scripts/slurm_up.sh ({p.stderr[-500:]})")
    p = subprocess.run(["sinfo", "-h", "-o", "%D %t"], capture_output=True, text=True)
    need(p.returncode == 0, "sinfo")
    return True


def _wait_for(cond, timeout, what):
    t0 = time.time()
    while not cond():
        if time.time() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


@pytest.mark.slurm
def test_submit_runs_a_het_job_to_completion(slurm, tmp_path):
    job = submit(str(ROOT / "configs/local.yaml"), [*SMALL, "run.steps=5", f"run.output_dir={tmp_path}"])
    h5 = job.result(timeout=240)
    check_exactly_once(h5, 5)
    log = job.stdout.read_text()
    assert "4 ranks" in log and "step    5/5" in log
    p = subprocess.run(["sacct", "-n", "-P", "-j", job.job_id, "-o", "JobID"], capture_output=True, text=True)
    assert {f"{job.job_id}+0", f"{job.job_id}+1", f"{job.job_id}+2"} <= set(p.stdout.split())


@pytest.mark.slurm
def test_signalled_job_checkpoints_requeues_and_finishes_exactly_once(slurm, tmp_path):
    job = submit(str(ROOT / "configs/local.yaml"), [*SMALL, "run.steps=60", f"run.output_dir={tmp_path}"])
    _wait_for(lambda: job.stdout.exists() and "step    5/" in job.stdout.read_text(), 180, "5 steps")
    job.signal("USR1")                      # what --signal=USR1@N does before the time limit
    _wait_for(lambda: "requeueing" in job.stdout.read_text(), 60, "the checkpoint and requeue")
    _wait_for(lambda: job.state == "PENDING", 60, "the requeued job")
    # a requeued job is held ~2 min (BeginTime); release it now
    subprocess.run(["scontrol", "update", f"jobid={job.job_id}", "StartTime=now"], check=True)
    h5 = job.result(timeout=300)
    log = job.stdout.read_text()
    assert "restart 1" in log and "resumed at versions" in log
    check_exactly_once(h5, 60)
