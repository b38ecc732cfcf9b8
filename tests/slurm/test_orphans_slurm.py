"""No process outlives its job, under Slurm (issue 35): a tool rank SIGKILLed while a sandbox
and a reward worker are mid-call leaves nothing behind (multiprocessing's forkserver,
resource tracker and workers, the sandbox's launcher: flexmarl_hpc/tools/lifeline.py), and
no component of the job sits in COMPLETING waiting for them. On the local cluster of
scripts/slurm_up.sh (fixture `slurm`); the same kill under mpiexec:
tests/e2e/test_episodes_e2e.py::test_a_killed_tool_rank_leaves_no_process_behind.

    pytest tests/slurm/test_orphans_slurm.py
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from flexmarl_hpc.submit import submit
from tests.conftest import ROOT
from tests.helpers import job_tails, left_behind, wait_for

sys.path.insert(0, str(ROOT / "scripts"))
import faults  # noqa: E402  (scripts/faults.py: rank_pids finds ranks by PMI_RANK and a tag)

TOOL_RANK = 3                     # orchestrator, replica, trainer, tool rank


def mid_call(tag: str):
    """(the tool rank's pid, the processes below it) once a sandbox and a reward worker are
    mid-call there (tests/e2e/episodes.py:slow_tools); False before."""
    tool = faults.rank_pids(tag, "flexmarl_hpc.run").get(TOOL_RANK)
    try:
        below = psutil.Process(tool).children(recursive=True) if tool else []
        cmds = [" ".join(q.cmdline()) for q in below]
    except psutil.Error:                             # one ended while we looked
        return False
    served = sum("multiprocessing.forkserver" in c for c in cmds)   # the server and a worker
    return served >= 2 and any("tools/launcher.py" in c for c in cmds) and (tool, below)


def completing(job_id: str) -> list[str]:
    """The job's components squeue shows in COMPLETING."""
    p = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i %T"], capture_output=True, text=True, timeout=30)
    return [line for line in p.stdout.splitlines() if line.endswith("COMPLETING")]


@pytest.mark.slurm
def test_a_killed_tool_rank_leaves_no_process_and_no_completing_component(slurm, tmp_path, monkeypatch):
    from make_tiny_chat_model import make
    model = make(tmp_path / "tiny-chat", hidden=32, layers=2, max_seq_len=512)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": i + 1}) + "\n" for i in range(8)))
    tag = uuid.uuid4().hex
    monkeypatch.setenv("FLEXMARL_FAULT_TAG", tag)        # sbatch exports it: the ranks carry it
    # slurm.requeue=false: the job ends at the kill (exit 75), no restart brings new tagged ranks
    ov = ["run.name=orph", "workflow.episode=tests.e2e.episodes:slow_tools", "workflow.agents=[solver]",
          "workflow.inputs_per_step=2", "workflow.group_size=2", "workflow.max_new_tokens=4",
          f"workflow.dataset.train={data}", "workflow.dataset.eval=", f"model.checkpoint={model}",
          "rollout.max_model_len=512", "run.steps=2", "run.log_every=1", "trainer.micro_batch_size=4",
          "tools.ranks=1", "tools.workers=2", "tools.wall_s=60", "slurm.tools={cpus_per_task: 2}",
          "slurm.requeue=false", f"run.output_dir={tmp_path / 'run'}"]
    run = submit(str(ROOT / "configs/math_team.yaml"), ov)
    below, left, stuck = [], {}, []
    try:
        tool, below = wait_for(lambda: mid_call(tag), 300, "a sandbox and a reward worker mid-call on the tool rank")
        os.kill(tool, signal.SIGKILL)
        wait_for(lambda: not faults.rank_pids(tag, "flexmarl_hpc.run"), 120, "every rank to end")
        time.sleep(5.0)
        left, stuck = left_behind(tag, below), completing(run.job_id)
        print(f"killed tool rank {tool} ({len(below)} processes below it); 5 s after the last rank: "
              f"left {left}, completing {stuck}")
    finally:
        run.cancel(check=False)
        for pid in left_behind(tag, below):          # a failing test leaves nothing either
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not left, f"5 s after the last rank these were left: {left}\n{job_tails(run)}"
    assert not stuck, f"5 s after the last rank components still COMPLETING: {stuck}\n{job_tails(run)}"
