"""GPU: a TP2 vLLM replica built through our engine (VLLMEngine, gpus_per_replica=2) takes one
weight sync over NCCL (issue 36). vLLM runs its two TP workers as processes spawned by the
replica rank after it set its CUDA device, with the rank's MPI environment: they join the
(trainer group, pool) sync group themselves (`flexmarl_join`) and receive the buckets
(`flexmarl_recv`); a worker that initialised MPI would die in PMI_Init at the join. Two MPI
ranks, 3 GPUs: rank 0 a trainer sender on one GPU, rank 1 the replica on the next two. Then
each worker holds the sent fingerprint and the replica samples. The CPU counterpart, with
spawned stand-in workers over gloo: tests/mpi/mpi_vllm_workers.py.

    mpiexec -n 2 python -m mpi4py tests/gpu/gpu_vllm_tp2.py     # on a GPU node with vllm
    pytest tests/gpu/gpu_vllm_tp2.py                             # skipped without 3 GPUs

Nothing MPI at the top: vLLM's spawned workers re-run this file as `__mp_main__`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("FLEXMARL_GPU_PYTHON", sys.executable)
FINGERPRINT = 3.0


def _norm_values(worker) -> list[float]:
    """Run in each vLLM worker (collective_rpc pickles it by value): its final norm's values
    (replicated on every TP rank, so each holds the whole tensor)."""
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    return sorted(set(model.model.norm.weight.float().cpu().tolist()))


def main() -> None:
    from mpi4py import MPI

    from flexmarl_hpc.config.sync_groups import SyncGroup
    from flexmarl_hpc.learn.model import ModelArgs, build_model, hf_state_dict
    from flexmarl_hpc.runtime.devices import Binding, apply_binding, visible_gpus

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    gpus = visible_gpus(os.environ) or [str(i) for i in range(3)]
    # what devices.bind_rank does: a trainer rank sets its GPU, a replica narrows to its block
    apply_binding(Binding("cuda:0", visible=None if rank == 0 else ",".join(gpus[1:3])))
    # head_dim 32 (vLLM's attention backends), heads divisible by TP 2
    args = ModelArgs(vocab_size=128, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=256, max_seq_len=64)
    groups = [SyncGroup(0, 0, (0,), (1,), ("a",))]
    if rank == 0:
        named = {k: v.cuda() for k, v in hf_state_dict(build_model(args, seed=1)).items()}
        named["model.norm.weight"].fill_(FINGERPRINT)
        send(world, groups, named)
    else:
        replica(world, groups, args)


def send(world, groups, named) -> None:
    import torch

    from flexmarl_hpc.runtime.weight_sync import SyncPlan, SyncChannels, layout_of, plan_buckets, send_weights
    channels = SyncChannels(world, "nccl", timeout_s=600)
    channels.open(groups)
    named.pop("lm_head.weight", None)                  # tied: vLLM takes the embedding
    plan = SyncPlan((0,), (plan_buckets(layout_of(named), 1 << 16, torch.bfloat16),))   # pieces too
    send_weights(channels, (1,), plan, 1, 0, named.items(), leader=True)
    channels.close()


def replica(world, groups, args) -> None:
    import torch

    from flexmarl_hpc.config.schema import RolloutConfig
    from flexmarl_hpc.learn.sampling import SamplingParams
    from flexmarl_hpc.rollout.base import GenRequest
    from flexmarl_hpc.rollout.vllm_engine import VLLMEngine
    from flexmarl_hpc.runtime import messages
    from flexmarl_hpc.runtime.timing import WorkerClock
    from flexmarl_hpc.runtime.weight_sync import SyncChannels
    from flexmarl_hpc.ranks.workers import replica_sync
    task = types.SimpleNamespace(stop_tokens=(), allowed_tokens=lambda turn: None)
    gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    engine = VLLMEngine({"a": args}, task, RolloutConfig(backend="vllm", max_batch=4, gpus_per_replica=2,
                                                         dtype="bf16"),
                        cuda=True, gpu_memory_gb=gb, bucket_bytes=1 << 16)
    assert engine.tp == 2
    channels = SyncChannels(world, "nccl", timeout_s=600)
    channels.open(groups, lambda g: engine.remote(g.agents[0]))     # builds the LLM; its workers join
    got = replica_sync(channels, engine, messages.Sync("a", 1, (0, 1)), 0, WorkerClock(), [time.time()])
    assert got == 1 and engine.version("a") == 1
    (eng,) = engine.engines.values()
    norms = eng.llm.collective_rpc(_norm_values)
    assert norms == [[FINGERPRINT], [FINGERPRINT]], norms           # both TP workers loaded the sync
    gen, = engine.generate("a", [GenRequest("s", [1, 4, 7], seed=0, max_new_tokens=4, turn=0)],
                           SamplingParams(1.0, 1.0))
    assert len(gen.tokens) == 4 and all(lp <= 0 for lp in gen.logprobs), gen
    channels.close()                                  # the workers leave their group first
    engine.close()
    print(f"gpu vllm tp2 ok: 2 TP workers joined, loaded v1 (norm {norms[0]}), sampled {gen.tokens}",
          flush=True)


def test_tp2_vllm_replica_takes_a_weight_sync_over_nccl():
    """(marker gpu: by folder, tests/conftest.py; pytest is imported here, not at the top: the
    driver runs on the GPU python, which need not have it)"""
    import pytest
    torch = pytest.importorskip("torch")
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == 0:
        pytest.skip("no GPU: a TP2 vLLM replica's workers (NCCL weight sync) cannot run here")
    if have < 3:
        pytest.skip(f"needs 3 GPUs (a trainer sender and a TP2 replica), this node has {have}")
    from tests.conftest import mpiexec_path
    mpiexec = mpiexec_path()
    if mpiexec is None:
        pytest.skip("mpiexec missing")
    p = subprocess.run([mpiexec, "-n", "2", PYTHON, "-m", "mpi4py", "tests/gpu/gpu_vllm_tp2.py"], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-5000:]}"
    assert "gpu vllm tp2 ok" in p.stdout, p.stdout[-3000:]


if __name__ == "__main__":
    main()
