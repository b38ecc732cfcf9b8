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

from tests.conftest import ROOT, mpiexec_path

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
