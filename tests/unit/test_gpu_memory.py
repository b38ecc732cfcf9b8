"""config/gpu_memory.py: what a GPU rank holds beyond its tensors (CUDA context, NCCL
communicators counted from the layout, fragmentation), and the vLLM fraction that leaves
room for the sync communicators a replica joins after its engine started."""
from __future__ import annotations

import dataclasses

import pytest

from flexmarl_hpc.config.plan import resolve
from tests.conftest import ROOT

PAPER = str(ROOT / "configs" / "paper_3x32b_7x14b.yaml")
GB = 1e9


def _paper():
    from flexmarl_hpc.config.load import load_config
    return load_config(PAPER)


def test_an_nccl_communicator_is_its_buffers_by_nccl_defaults_or_the_measured_688_mb(monkeypatch):
    from flexmarl_hpc.config import gpu_memory as gm
    per_connection = 4 * 2**20 + 4_915_200 + 524_288          # Simple + LL128 + LL
    assert gm.NCCL_BUFFSIZE + gm.NCCL_LL128_BYTES + gm.NCCL_LL_BYTES == per_connection
    assert 32 * 2 * per_connection == 616_562_688 < gm.nccl_comm_bytes() == 688_000_000
    monkeypatch.setattr(gm, "NCCL_CHANNELS", 64)                # more channels: the buffers decide
    assert gm.nccl_comm_bytes() == 64 * 2 * per_connection


def test_allowances_add_the_context_each_communicator_and_a_tenth_for_fragmentation():
    from flexmarl_hpc.config.gpu_memory import CUDA_CONTEXT_BYTES, allowances, nccl_comm_bytes
    a = allowances(int(30 * GB), 4)
    assert (a.context, a.nccl, a.comms, a.fragmentation) == (CUDA_CONTEXT_BYTES, 4 * nccl_comm_bytes(), 4,
                                                             int(3 * GB))
    assert a.total == CUDA_CONTEXT_BYTES + 4 * nccl_comm_bytes() + int(3 * GB)
    assert allowances(0, 2, context=False).total == 2 * nccl_comm_bytes()     # vLLM's budget holds its context


def test_trainer_communicators_are_counted_per_rank_from_the_layout():
    """32B groups: TP 8 x PP 2 x DP 2; each stage's sender also holds the (group, p32) sync
    communicator, the last rank does not. 14B groups: TP 4 x DP 4, one stage."""
    from flexmarl_hpc.config.gpu_memory import trainer_comms
    cfg = _paper()
    base = ["default group", "tensor parallel", "data parallel", "pipeline parallel"]
    assert trainer_comms(resolve(cfg), 0, 0) == base + ["sync p32"]
    assert trainer_comms(resolve(cfg), 0, 16) == base + ["sync p32"]          # stage 1's sender
    assert trainer_comms(resolve(cfg), 0, 31) == base
    assert trainer_comms(resolve(cfg), 3, 0) == ["default group", "tensor parallel", "data parallel", "sync p14"]
    assert trainer_comms(resolve(cfg), 3, 15) == ["default group", "tensor parallel", "data parallel"]


def test_tied_embeddings_add_the_embedding_group_on_the_first_and_last_stage_only():
    from flexmarl_hpc.config.gpu_memory import trainer_comms
    cfg = _paper()
    agents = {k: dataclasses.replace(m, tie_embeddings=True) for k, m in cfg.agents.items()}
    tied = dataclasses.replace(cfg, agents=agents)
    assert "embedding" in trainer_comms(resolve(tied), 0, 0) and "embedding" in trainer_comms(resolve(tied), 0, 31)
    pp4 = dataclasses.replace(tied, trainer=dataclasses.replace(tied.trainer, named_groups=[
        dataclasses.replace(tied.trainer.named_groups[0], tensor_parallel=4, pipeline_parallel=4),
        *tied.trainer.named_groups[1:]]))
    assert "embedding" not in trainer_comms(resolve(pp4), 0, 8)             # stage 1 of 4: no embedding
    assert "embedding" in trainer_comms(resolve(pp4), 0, 24)                # stage 3, the last


def test_a_replica_joins_one_sync_communicator_per_trainer_group_feeding_its_pool():
    from flexmarl_hpc.config.gpu_memory import replica_sync_comms
    cfg = _paper()
    assert replica_sync_comms(resolve(cfg), 0) == ["sync shop32_0", "sync shop32_1", "sync shop32_2"]
    assert len(replica_sync_comms(resolve(cfg), 1)) == 7


def test_the_vllm_fraction_leaves_the_sync_communicators_room():
    """p14's workers join 7 sync communicators after vLLM sized its KV cache: the fraction,
    a bucket with its rounding and 7 x NCCL's buffers fit the 64 GB GPU. The fraction that
    left a fixed 1 GB for NCCL (before) put the same receive at 64.9 GB."""
    from flexmarl_hpc.config.gpu_memory import FRAGMENTATION, nccl_comm_bytes
    from flexmarl_hpc.rollout.vllm_engine import memory_fraction
    bucket = 2**30
    f7 = memory_fraction(64, bucket, 7)
    assert f7 * 64 * GB + bucket * (1 + FRAGMENTATION) + 7 * nccl_comm_bytes() <= 64 * GB
    assert f7 < memory_fraction(64, bucket, 1) <= 0.92
    old = round(min(0.92, 1.0 - (bucket / 2**30 + 1.0) / 64), 4)
    assert old * 64 * GB + bucket * (1 + FRAGMENTATION) + 7 * nccl_comm_bytes() > 64 * GB
    with pytest.raises(ValueError, match="sync communicator"):
        memory_fraction(16, bucket, 12)
