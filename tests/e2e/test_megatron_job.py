"""End to end: the whole job with 2-rank megatron trainer groups, through the final
checkpoint and a resume (`python -m flexmarl_hpc.run`, real MPI, real HDF5).

A sharded trainer's `state()` is collective over its group; a checkpoint gathered by the
leader alone left every rank waiting forever after the last step (issue 14). One chain of
three runs in one output directory covers both layouts, each saving and loading:
DP2 saves -> TP2 resumes and saves -> DP2 resumes and saves; then the newest checkpoint
of one agent is corrupted and a TP2 resume falls back to the one before it. Megatron
checkpoints are dist_checkpointing folders published through checkpoint.py (sha256
manifest, atomic rename): each rank writes its own shards, nothing gathers the full state.
"""
from __future__ import annotations

import importlib.util
import json

import pytest

from flexmarl_hpc.store.checkpoint import newest_valid
from tests.conftest import need, run_training
from tests.helpers import check_exactly_once

pytestmark = pytest.mark.megatron

TINY = ["run.log_every=1", "workflow.inputs_per_step=4", "trainer.micro_batch_size=8",
        "model.hidden_size=32", "model.intermediate_size=64", "trainer.backend=megatron",
        "trainer.ranks_per_group=2"]


def _versions(out) -> dict[str, int]:
    got = {}
    for agent in ("speaker", "listener"):
        version, entry = newest_valid(out / "checkpoints" / agent)
        assert entry.is_dir() and (entry / "metadata.json").is_file(), entry   # dist_checkpointing
        assert json.loads((entry / "flexmarl.json").read_text())["version"] == version
        got[agent] = version
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
    # overwrite bytes of one shard file of speaker's newest entry: the resume reports it and
    # loads v3 (the manifest's sha256 no longer matches), listener stays at v4
    shard = max((p for p in (tmp_path / "checkpoints/speaker/v000004").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        f.write(b"\xff" * 16)
    p = run_training(tmp_path, *TINY, "trainer.tensor_parallel=2", "run.steps=5", timeout=300)
    assert "bad checkpoint, skipped" in p.stdout and "sha256 does not match" in p.stdout, p.stdout[-2000:]
    assert "resumed at versions {'speaker': 3, 'listener': 4}" in p.stdout
    assert _versions(tmp_path) == {"speaker": 5, "listener": 5}
    check_exactly_once(tmp_path / "local.h5", 5)


def test_megatron_agents_swapped_on_one_group(mpiexec, tmp_path):
    """Both agents on one 2-rank megatron group (pipeline.swap_states): the idle agent is
    offloaded to host buffers and onloaded for its turn (no rebuild), its weights are synced
    and checkpointed while it is parked; then a resume."""
    need(importlib.util.find_spec("megatron.core") is not None, "megatron-core")
    swap = [*TINY, "trainer.groups=1", "pipeline.swap_states=true"]
    p = run_training(tmp_path, *swap, "run.steps=3", timeout=300)
    assert "step    3/3" in p.stdout
    assert _versions(tmp_path) == {"speaker": 3, "listener": 3}
    import h5py
    with h5py.File(tmp_path / "local.h5", "r") as f:
        acts = f["intervals"]["activity"].tolist()
    assert acts.count(b"swap") >= 2 * 3, acts.count(b"swap")     # both ranks, at least once a step
    p = run_training(tmp_path, *swap, "run.steps=4", timeout=300)
    assert "resumed at versions {'speaker': 3, 'listener': 3}" in p.stdout
    assert _versions(tmp_path) == {"speaker": 4, "listener": 4}
    check_exactly_once(tmp_path / "local.h5", 4)
