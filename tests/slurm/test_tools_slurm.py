"""tools.ranks under Slurm: the tool ranks are the het job's last component and run under
the same srun step as every other rank (one MPI_COMM_WORLD); the episodes' tool calls and
reward functions run there.

    pytest tests/slurm/test_tools_slurm.py        # real Slurm; brings the local cluster up (root)
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import h5py
import pytest

from flexmarl_hpc.store.schema import TOOL_OUTCOMES
from flexmarl_hpc.submit import main as submit_main
from tests.conftest import ROOT


@pytest.mark.slurm
def test_tool_calls_run_on_the_tools_het_component(slurm, tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_tiny_chat_model import make
    model = make(tmp_path / "tiny-chat", hidden=32, layers=2, max_seq_len=512)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": i + 1}) + "\n" for i in range(8)))
    out = tmp_path / "run"
    ov = ["run.name=tl", "workflow.episode=tests.e2e.episodes:with_tools", "workflow.agents=[solver]",
          "workflow.inputs_per_step=2", "workflow.group_size=2", "workflow.max_new_tokens=4",
          f"workflow.dataset.train={data}", "workflow.dataset.eval=", f"model.checkpoint={model}",
          "rollout.max_model_len=512", "run.steps=2", "run.log_every=1", "trainer.micro_batch_size=4",
          "tools.ranks=1", "tools.workers=2", "slurm.tools={cpus_per_task: 2}", f"run.output_dir={out}"]
    assert submit_main(["configs/math_team.yaml", *ov, "--wait", "--timeout", "600"]) == 0
    script = next((out / "logs").glob("*.sbatch")).read_text()
    assert script.count("#SBATCH hetjob") == 3 and "# component 3: tools" in script
    job_id = next((out / "logs").glob("*.out")).stem
    p = subprocess.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State"],
                       capture_output=True, text=True, timeout=30)
    states = dict(line.split("|") for line in p.stdout.split())
    assert states == {f"{job_id}+{i}": "COMPLETED" for i in range(4)}, p.stdout
    with h5py.File(out / "tl.h5", "r") as f:
        tools, solver = f["tools"][:], f["samples/solver"][:]
    outcomes = Counter((t.decode(), TOOL_OUTCOMES[o]) for t, o in zip(tools["tool"], tools["outcome"]))
    assert outcomes == {("calculator", "ok"): 8, ("python", "ok"): 8, ("die", "crashed"): 8, ("where", "ok"): 8}, \
        outcomes
    assert (solver["reward"] >= 0.5).all(), solver["reward"]      # `where` ran on the tool rank, not rank 0


@pytest.mark.slurm
def test_a_killed_tool_rank_ends_the_job_which_slurm_requeues_and_the_run_completes_exactly_once(
        slurm, tmp_path, monkeypatch):
    """issue 35: a lost tool rank ends in a requeue by Slurm alone (the requeue file, not
    srun's 137), and the restarted job trains every sample once."""
    import os
    import signal
    import uuid
    sys.path.insert(0, str(ROOT / "scripts"))
    import faults
    from make_tiny_chat_model import make
    from flexmarl_hpc.submit import submit
    from tests.helpers import check_exactly_once, job_tails, steps_logged, wait_for
    model = make(tmp_path / "tiny-chat", hidden=32, layers=2, max_seq_len=512)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": i + 1}) + "\n" for i in range(8)))
    tag = uuid.uuid4().hex
    monkeypatch.setenv("FLEXMARL_FAULT_TAG", tag)        # sbatch exports it: the ranks carry it
    steps, out = 12, tmp_path / "run"
    ov = ["run.name=tk", "workflow.episode=tests.e2e.episodes:with_tools", "workflow.agents=[solver]",
          "workflow.inputs_per_step=2", "workflow.group_size=2", "workflow.max_new_tokens=4",
          f"workflow.dataset.train={data}", "workflow.dataset.eval=", f"model.checkpoint={model}",
          "rollout.max_model_len=512", f"run.steps={steps}", "run.log_every=1", "trainer.micro_batch_size=4",
          "tools.ranks=1", "tools.workers=2", "slurm.tools={cpus_per_task: 2}", "slurm.start_timeout=60",
          f"run.output_dir={out}"]
    run = submit(str(ROOT / "configs/math_team.yaml"), ov)
    try:
        wait_for(lambda: steps_logged(run) >= 2, 300, "2 steps")
        tool = wait_for(lambda: faults.rank_pids(tag, "flexmarl_hpc.run").get(3), 30, "the tool rank")
        os.kill(tool, signal.SIGKILL)
        wait_for(lambda: "requeueing" in run.stdout() or "not requeueing" in run.stdout(), 120,
                 "the batch script's end")
        assert "exit 75 (tool rank 0 (rank 3) was lost or hung): requeueing" in run.stdout(), job_tails(run)
        h5 = run.result(timeout=600)                      # wait() releases the requeue hold
        assert f"job {run.job_id} restart 1" in run.stdout(), job_tails(run)
        assert steps_logged(run) == steps
        check_exactly_once(h5, steps)
    finally:
        run.cancel(check=False)
