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

from flexmarl_hpc.store.tables import TOOL_OUTCOMES
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
