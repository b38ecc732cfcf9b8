"""megatron-core backend on CPU (gloo): real 2- and 4-rank trainer groups under mpiexec.

Each case runs tests/mpi_megatron.py, which checks a megatron trainer group against the torch
reference trainer on the same init weights and batches: logits, GRPO losses and grad norms
over 2 steps of 2 accumulated micro-batches, weights after the steps, the training state
(TorchTrainer's format, Adam moments included) and loading a TorchTrainer state (the DP/TP
model has Qwen2's QKV biases, random, the PP ones tied embeddings); and, for checkpoints, a
TP2 dist_checkpointing save loaded into TP1xDP2 and PP2 (resharding, odd vocab size 23).
Needs megatron-core (requirements-megatron.txt): under CI=true a missing megatron fails,
elsewhere the tests skip with that reason.

    .venv/bin/python -m pytest tests/test_megatron.py
"""
from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import need, run_mpi

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def megatron(mpiexec) -> str:
    need(importlib.util.find_spec("megatron") is not None
         and importlib.util.find_spec("megatron.core") is not None,
         "megatron-core (pip install -r requirements-megatron.txt)")
    return mpiexec


def _run(mpiexec: str, n: int, *args: str) -> str:
    p = run_mpi(mpiexec, n, ["tests/mpi_megatron.py", *args], timeout=240,
                env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert "all megatron checks passed" in p.stdout, p.stdout[-3000:]
    print("\n".join(line for line in p.stdout.splitlines() if line.startswith("ok")))
    return p.stdout


def test_data_parallel_group_matches_torch_trainer(megatron):
    out = _run(megatron, 2, "dp")
    assert "ok dp: losses" in out and "ok dp: state() == TorchTrainer.state()" in out


def test_tensor_parallel_matches_torch_and_tp1_loss(megatron):
    out = _run(megatron, 2, "dp", "tp")
    assert "ok tp: losses" in out and "ok TP2 loss == TP1 (DP2) loss" in out
    assert "megatron logits == torch logits (QKV biases)" in out


def test_pipeline_parallel_with_tied_embeddings_matches_torch(megatron):
    out = _run(megatron, 2, "pp")
    assert "ok pp: losses" in out and "ok pp: load_state(TorchTrainer state)" in out


def test_checkpoint_saved_with_tp2_loads_into_tp1_and_pp2(megatron, tmp_path):
    out = _run(megatron, 2, "ckpt", str(tmp_path / "ckpt"))
    assert "-> TP1xPP1xDP2 load" in out and "-> TP1xPP2xDP1 load" in out
    assert "vocab 23 padded to 128 at every TP" in out


def test_four_ranks_tp2_dp2_and_tp2_pp2(megatron):
    # "tp" on 4 ranks is TP2 x DP2, "tppp" is TP2 x PP2
    out = _run(megatron, 4, "tp", "tppp")
    assert "ok tp: losses" in out and "ok tppp: losses" in out
