"""End to end: the whole job with 2-rank megatron trainer groups, through the final
checkpoint and a resume (`python -m flexmarl_hpc.run`, real MPI, real HDF5).

A sharded trainer's `state()` is collective over its group; a checkpoint gathered by the
leader alone left every rank waiting forever after the last step (issue 14). One chain of
three runs in one output directory covers both layouts, each saving and loading:
DP2 saves -> TP2 resumes and saves -> DP2 resumes and saves.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.conftest import need, run_training
from tests.test_run import check_exactly_once

pytestmark = pytest.mark.megatron

TINY = ["run.log_every=1", "workflow.inputs_per_step=4", "trainer.micro_batch_size=8",
        "model.hidden_size=32", "model.intermediate_size=64", "trainer.backend=megatron",
        "trainer.ranks_per_group=2"]


def _versions(out) -> dict[str, int]:
    got = {}
    for agent in ("speaker", "listener"):
        ckpt = out / "checkpoints" / agent
        got[agent] = int(torch.load(ckpt / (ckpt / "latest").read_text(), weights_only=True)["version"])
    return got


def test_two_rank_megatron_groups_checkpoint_and_resume(mpiexec, tmp_path):
    need(importlib.util.find_spec("megatron.core") is not None, "megatron-core")
    p = run_training(tmp_path, *TINY, "run.steps=2", timeout=300)       # DP2
    assert "step    2/2" in p.stdout and _versions(tmp_path) == {"speaker": 2, "listener": 2}
    p = run_training(tmp_path, *TINY, "trainer.tensor_parallel=2", "run.steps=3", timeout=300)
    assert "resumed at versions {'speaker': 2, 'listener': 2}" in p.stdout
    assert _versions(tmp_path) == {"speaker": 3, "listener": 3}
    p = run_training(tmp_path, *TINY, "run.steps=4", timeout=300)       # DP2 again
    assert "resumed at versions {'speaker': 3, 'listener': 3}" in p.stdout
    assert _versions(tmp_path) == {"speaker": 4, "listener": 4}
    check_exactly_once(tmp_path / "local.h5", 4)
