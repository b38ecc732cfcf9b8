"""GPU end to end through the production path: `python -m flexmarl_hpc.run` (its own
mpiexec) -> devices.bind_rank -> megatron-core trainers in bf16 -> weight_sync over NCCL ->
vLLM replicas in bf16; then the run's HDF5 store and checkpoints are checked. No side path:
the same command a user runs, with GPU overrides.

    .venv-vllm/bin/python -m pytest tests/gpu/gpu_megatron_vllm.py      (collected by scripts/test.sh)
    FLEXMARL_GPU_PYTHON=/path/to/python ...   # the python the job runs on: vllm (GPU wheel),
                                              # megatron-core, mpi4py; default: this one

Without a GPU every test here skips, with the reason in pytest's summary (`-ra`). It has
never run: no GPU has been available to this project (README, "GPU paths").
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import run_training

pytestmark = [pytest.mark.gpu, pytest.mark.megatron, pytest.mark.vllm]
PYTHON = os.environ.get("FLEXMARL_GPU_PYTHON", sys.executable)


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def need_gpus(n: int) -> None:
    have = gpu_count()
    if have == 0:
        pytest.skip("no GPU: the GPU production path (run.py -> megatron bf16 -> NCCL weight sync -> "
                    "vLLM) cannot run here")
    if have < n:
        pytest.skip(f"needs {n} GPUs (vLLM replicas and megatron trainer ranks each take their own), "
                    f"this node has {have}")
    p = subprocess.run([PYTHON, "-c", "import vllm, megatron.core, mpi4py"], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.fail(f"{PYTHON} has a GPU but lacks vllm / megatron-core / mpi4py "
                    f"(set FLEXMARL_GPU_PYTHON): {p.stderr.strip().splitlines()[-1:]}")


GPU = ["rollout.backend=vllm", "rollout.dtype=bf16", "trainer.backend=megatron", "trainer.precision=bf16",
       "weight_sync.backend=nccl", "run.log_every=1", "workflow.inputs_per_step=8",
       "trainer.micro_batch_size=16",
       # head_dim 32: vLLM's attention backends do not all take the default tiny model's 16
       "model.num_heads=2", "model.num_kv_heads=2"]


def check_store(out, steps: int) -> None:
    """Every agent trained `steps` steps, each sample once; the all-sample truncated importance
    weight and the bf16 vLLM-vs-megatron log-prob mismatch are recorded per step and small."""
    import h5py

    from tests.helpers import check_exactly_once
    check_exactly_once(out / "local.h5", steps)
    with h5py.File(out / "local.h5", "r") as f:
        for agent in f.attrs["agents"]:
            st = f[f"steps/{agent}"][:]
            st = st[st["superseded"] == 0]
            mism, tis = st["logp_mismatch"], st["tis_mean"]
            assert np.all(np.isfinite(mism)) and np.all(np.isfinite(tis)), (agent, mism, tis)
            # bf16 engines and bf16 trainer on the same weights: close, not equal
            assert np.all(mism < 0.1) and np.all(np.abs(tis - 1) < 0.1), (agent, mism, tis)


def _versions(out) -> dict[str, int]:
    from flexmarl_hpc.store.checkpoint import newest_valid
    got = {}
    for agent in ("speaker", "listener"):
        version, entry = newest_valid(out / "checkpoints" / agent)
        assert entry.is_dir(), f"{entry}: a megatron checkpoint is a dist_checkpointing folder"
        got[agent] = version
    return got


def test_job_vllm_megatron_nccl_one_group_per_agent(tmp_path):
    """1 vLLM replica + 2 one-rank megatron groups (3 GPUs), 4 steps, then a resume to 6."""
    need_gpus(3)
    p = run_training(tmp_path, *GPU, "run.steps=4", timeout=1200, python=PYTHON)
    assert "step    4/4" in p.stdout, p.stdout[-3000:]
    check_store(tmp_path, 4)
    assert _versions(tmp_path) == {"speaker": 4, "listener": 4}
    p = run_training(tmp_path, *GPU, "run.steps=6", timeout=1200, python=PYTHON)
    assert "resumed at versions {'speaker': 4, 'listener': 4}" in p.stdout
    check_store(tmp_path, 6)


def test_job_vllm_megatron_nccl_swapped_agents(tmp_path):
    """1 replica + 1 megatron group for both agents (2 GPUs): the agents' states swap through
    pinned host memory (offload/onload) between their steps; on the replica both agents
    share one vLLM engine (same architecture), switched by weight reload."""
    need_gpus(2)
    p = run_training(tmp_path, *GPU, "trainer.groups=1", "pipeline.swap_states=true", "run.steps=4",
                     timeout=1200, python=PYTHON)
    assert "step    4/4" in p.stdout, p.stdout[-3000:]
    check_store(tmp_path, 4)


def test_job_tp2_megatron_group(tmp_path):
    """1 replica + 2 groups of 2 megatron ranks in TP2 (5 GPUs): vocab-parallel log-probs on
    GPUs, the TP group's NCCL all-reduces, and a sync gathered from two shards."""
    need_gpus(5)
    p = run_training(tmp_path, *GPU, "trainer.ranks_per_group=2", "trainer.tensor_parallel=2", "run.steps=3",
                     timeout=1200, python=PYTHON)
    assert "step    3/3" in p.stdout, p.stdout[-3000:]
    check_store(tmp_path, 3)
