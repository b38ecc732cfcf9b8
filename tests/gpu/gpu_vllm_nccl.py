"""megatron-core training + vLLM sampling + NCCL weight transfer on real GPUs: runs
tests/gpu/gpu_megatron_vllm.py on 2 ranks with the vLLM venv's python. Skipped with
"no GPU" elsewhere."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.conftest import ROOT, mpiexec_path
from tests.helpers import vllm_python as _vllm_python


def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True).returncode == 0



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
    p = subprocess.run([mpiexec, "-n", "2", py, "-m", "mpi4py", "tests/gpu/gpu_megatron_vllm.py"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-5000:]}"
    assert "gpu megatron->vllm ok" in p.stdout
    print(p.stdout[-2000:])
