"""vLLM rollout engine (optional backend).

CPU: runs tests/vllm_check.py with the vLLM venv's python (bash scripts/setup_vllm_cpu.sh
builds .venv-vllm; FLEXMARL_VLLM_PYTHON points elsewhere). Skipped with a reason when that
venv is missing, unless FLEXMARL_VLLM=1 demands it (then it fails).
GPU: tests marked `gpu` run megatron-core training + vLLM sampling + NCCL weight transfer on
real GPUs (tests/gpu_megatron_vllm.py); skipped with "no GPU" elsewhere.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, mpiexec_path, run_training

VLLM_PY = Path(os.environ.get("FLEXMARL_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
DEMANDED = os.environ.get("FLEXMARL_VLLM", "") == "1"


def _vllm_python() -> str:
    if VLLM_PY.exists():
        return str(VLLM_PY)
    if DEMANDED:
        pytest.fail(f"FLEXMARL_VLLM=1 but {VLLM_PY} is missing (bash scripts/setup_vllm_cpu.sh)")
    pytest.skip(f"vLLM venv {VLLM_PY} missing: bash scripts/setup_vllm_cpu.sh (or FLEXMARL_VLLM_PYTHON=...)")


def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True).returncode == 0


@pytest.mark.vllm
def test_vllm_engine_matches_trainer_logprobs_and_updates_in_place():
    py = _vllm_python()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "WARNING"}
    p = subprocess.run([py, "tests/vllm_check.py"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-5000:]}"
    assert "all vllm checks passed" in p.stdout
    for line in p.stdout.splitlines():
        if line.startswith(("ok", "bench")):
            print(line)


@pytest.mark.vllm
def test_whole_job_with_vllm_replicas(tmp_path):
    """`python -m flexmarl_hpc.run` on the vLLM venv's python: two vLLM-cpu replicas serve
    the agents (weights loaded in place after every step), every sample trained once.
    head_dim 32: vLLM's CPU attention has no kernel for the default config's 16."""
    from tests.test_run import check_exactly_once
    py = _vllm_python()
    steps = 6
    p = run_training(tmp_path, "rollout.backend=vllm", "rollout.replicas=2", f"run.steps={steps}",
                     "run.log_every=1", "model.num_heads=2", "model.num_kv_heads=2", python=py, timeout=600)
    assert "5 ranks (2 replicas" in p.stdout
    check_exactly_once(tmp_path / "local.h5", steps)
    import h5py
    with h5py.File(tmp_path / "local.h5", "r") as f:
        served = set()
        for agent in ("speaker", "listener"):
            g = f[f"samples/{agent}"]
            served |= set(g["replica"][:].tolist())
            assert (g["policy_version"][:] == g["step"][:]).all()     # each step on fresh weights
    assert served == {0, 1}, "a replica did no work"


@pytest.mark.vllm
@pytest.mark.gpu
def test_gpu_megatron_training_feeds_vllm_through_nccl():
    if not _has_gpu():
        pytest.skip("no GPU")
    py = _vllm_python()
    mpiexec = mpiexec_path()
    if mpiexec is None:
        pytest.skip("mpiexec missing")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([mpiexec, "-n", "2", py, "-m", "mpi4py", "tests/gpu_megatron_vllm.py"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-5000:]}"
    assert "gpu megatron->vllm ok" in p.stdout
    print(p.stdout[-2000:])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
