"""vLLM rollout engine (optional backend).

CPU: runs tests/e2e/vllm_check.py with the vLLM venv's python (bash scripts/setup_vllm_cpu.sh
builds .venv-vllm; FLEXMARL_VLLM_PYTHON points elsewhere). Skipped with a reason when that
venv is missing, unless FLEXMARL_VLLM=1 demands it (then it fails).
GPU: tests marked `gpu` run megatron-core training + vLLM sampling + NCCL weight transfer on
real GPUs (tests/gpu/gpu_vllm_nccl.py, tests/gpu/gpu_megatron_vllm.py); skipped with "no GPU" elsewhere.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_training
from tests.helpers import vllm_python as _vllm_python

@pytest.mark.vllm
def test_vllm_engine_matches_trainer_logprobs_and_updates_in_place():
    py = _vllm_python()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "WARNING"}
    p = subprocess.run([py, "tests/e2e/vllm_check.py"], cwd=ROOT, env=env, capture_output=True,
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
    from tests.helpers import check_exactly_once
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


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
