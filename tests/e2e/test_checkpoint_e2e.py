"""A full disk during a real run's checkpoint: one line, the job stops, every committed
checkpoint verifies, and the same command resumes once there is room (the checkpoint files
themselves: tests/unit/test_checkpoint.py)."""
import subprocess

import pytest

from flexmarl_hpc.store import checkpoint as ck
from tests.conftest import run_training
from tests.helpers import tmpfs




@pytest.mark.parametrize("backend", ["torch", pytest.param("megatron", marks=pytest.mark.megatron)])
def test_disk_full_during_a_run_checkpoint(tmp_path, mpiexec, backend):
    """A real run whose output_dir (a 3 MiB tmpfs) fills up at the step-10 checkpoints
    (~1 MB per agent; megatron's dist checkpoint folders are written by the rank's threads):
    the trainer reports one line naming the checkpoint and "no space left", the job stops
    with 75 (Slurm requeues; it was 1),
    the failed checkpoint leaves no .tmp and every committed one still verifies. The job's
    abort may cut the other agent's save short (a kill at any instant); once there is room
    again, the same command resumes, drops that unfinished entry and trains every sample
    exactly once."""
    from tests.helpers import check_exactly_once
    args = ("run.steps=30", "run.checkpoint_every=10", "run.checkpoint_minutes=0",
            # the 8-object game (the default config before issue 15): its store stays small
            # enough that the checkpoints, not the store, fill the 3 MiB
            "workflow.task_args.num_objects=8", "workflow.inputs_per_step=8",
            "run.eval_every=0", f"trainer.backend={backend}")
    with tmpfs(tmp_path, "3m") as mnt:
        out = mnt / "run"
        p = run_training(out, *args, check=False, timeout=300)
        text = p.stdout + p.stderr
        assert p.returncode == 75, text         # EXIT_REQUEUE: free space, run the same command
        line = next((l for l in text.splitlines() if "checkpoint error:" in l), text[-3000:])
        assert "no space left" in line and str(out / "checkpoints") in line, line
        assert "unexpected pos" not in text and "checkpoint.py" not in text, text
        ckpts = out / "checkpoints"
        failed = next(a for a in ckpts.iterdir() if f"{a}/" in line)
        assert not list(failed.glob("*.tmp")), line
        for agent in ckpts.iterdir():
            for v in ck.committed_versions(agent):
                assert ck.verify(agent, v)[0] is not None

        subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)
        for agent in ckpts.iterdir():         # where the abort cut no save short, stage one
            if agent != failed and not list(agent.glob("*.tmp")):
                (agent / "v000010.tmp").mkdir()
                (agent / "v000010.tmp" / "__0_0.distcp").write_bytes(b"cut short")
        run_training(out, *args, timeout=300)
        assert not list(ckpts.rglob("*.tmp"))
        check_exactly_once(out / "local.h5", 30)
