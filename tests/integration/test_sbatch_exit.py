"""How the batch script reads the end of its step (launch/sbatch.py `_wait_srun`), run for real
in bash with a stand-in `srun` and `scontrol` on PATH: the same text a job runs, each case a
way a step can end. The case that matters: a step killed by a signal in which no rank wrote
anything, as Open MPI under PMIx leaves it when one rank is SIGKILLed (it kills the others
before they notice; docs/slurm.md), is a lost rank and is requeued, while a genuine error
(a rank wrote the error file) ends the job FAILED."""
from __future__ import annotations

import os
import subprocess

import pytest

from flexmarl_hpc.config.load import load_plan
from flexmarl_hpc.launch.sbatch import hetjob_script
from tests.conftest import ROOT

CASES = {   # the stand-in srun's body -> (the script's exit, requeued?, the cause it names)
    "completed": ("exit 0", 0, False, None),
    "requeue file, then srun's 137": ('echo "replica 0 (rank 1) was lost" > "$FLEXMARL_REQUEUE_FILE"; exit 137',
                                      75, True, "replica 0 (rank 1) was lost"),
    "killed, no word (Open MPI/PMIx)": ("exit 137", 75, True, "a rank was lost (srun: 137)"),
    "error file, then srun's 137": ('echo "rank 2: ValueError: x" > "$FLEXMARL_ERROR_FILE"; exit 137', 137, False, None),
    "a plain exit 1": ("exit 1", 1, False, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_batch_script_requeues_a_lost_rank_and_fails_an_error(case, tmp_path):
    body, code, requeued, cause = CASES[case]
    out = tmp_path / "run"
    plan = load_plan(str(ROOT / "configs/local.yaml"), [f"run.output_dir={out}", "slurm.start_timeout=5"])
    script = tmp_path / "job.sbatch"
    script.write_text(hetjob_script(plan, "configs/local.yaml", python="python"))
    (out / "logs").mkdir(parents=True)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text(f"#!/bin/bash\n{body}\n")
    (bin_ / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/scontrol.calls\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SLURM_JOB_ID": "7"}
    env.pop("SLURM_RESTART_COUNT", None)
    p = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == code, p.stdout + p.stderr
    calls = tmp_path / "scontrol.calls"
    assert calls.exists() == requeued, p.stdout
    if requeued:
        assert calls.read_text().split() == ["requeue", "7"]
        assert f"exit 75 ({cause}" in p.stdout, p.stdout
