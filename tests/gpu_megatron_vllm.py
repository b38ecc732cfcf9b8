"""GPU end to end: megatron-core trains, vLLM samples, weights move GPU -> GPU over NCCL.

    mpiexec -n 2 .venv-vllm/bin/python -m mpi4py tests/gpu_megatron_vllm.py   (2 GPUs, or 1 shared)

Needs a python with vllm (the GPU wheel), megatron-core and mpi4py. Rank 0 is a one-rank
megatron trainer group (its own torch.distributed world over COMM_SELF, NCCL); rank 1 is a
vLLM replica. After one GRPO step, rank 0 streams the HF-named weights over a NCCL
communicator that is independent of either side's torch.distributed state (vLLM's
StatelessProcessGroup + PyNcclCommunicator), rank 1 loads them in place
(VLLMEngine.load_weights) and checks that vLLM's sampled-token log-probs equal those of our
torch model on the received weights, and that they moved away from version 0.
"""
from __future__ import annotations

import socket
import sys
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flexmarl_hpc.config import RolloutConfig, TrainerConfig  # noqa: E402
from flexmarl_hpc.grpo import MicroBatch  # noqa: E402
from flexmarl_hpc.model import CausalLM, ModelArgs, build_model, hf_state_dict  # noqa: E402
from flexmarl_hpc.sampling import SamplingParams  # noqa: E402

world = MPI.COMM_WORLD
assert world.Get_size() == 2, "run with mpiexec -n 2"
rank = world.Get_rank()
torch.cuda.set_device(rank % torch.cuda.device_count())
args = ModelArgs(vocab_size=40, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=512, max_seq_len=64, tie_embeddings=True)
init = hf_state_dict(build_model(args, seed=1, std=0.3))
names = sorted(init)

# NCCL channel trainer (0) -> replica (1), outside both torch.distributed worlds
if rank == 0:
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    addr = (socket.gethostbyname(socket.gethostname()), port)
else:
    addr = None
host, port = world.bcast(addr, root=0)
from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator  # noqa: E402
from vllm.distributed.utils import StatelessProcessGroup  # noqa: E402

pg = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=2)
nccl = PyNcclCommunicator(pg, device=torch.device("cuda", torch.cuda.current_device()))

if rank == 0:
    from flexmarl_hpc.trainer.megatron import MegatronTrainer
    cfg = TrainerConfig(backend="megatron", lr=1e-2, entropy_coef=0.01)
    tr = MegatronTrainer(args, cfg, MPI.COMM_SELF, 1.0, {k: v.clone() for k, v in init.items()})
    g = torch.Generator().manual_seed(0)
    B, T = 8, 12
    mb = MicroBatch(torch.randint(3, 40, (B, T), generator=g), torch.full((B,), 4),
                    torch.randint(2, 8, (B,), generator=g), torch.zeros(B, T), torch.randn(B, generator=g),
                    torch.zeros(B, dtype=torch.bool), None)
    stats = tr.forward_backward(mb, 1.0 / B)
    tr.optimizer_step()
    named = tr.named_weights()
    for k in names:
        nccl.broadcast(named[k].detach().to("cuda", torch.float32).contiguous(), src=0)
    torch.cuda.synchronize()
    print(f"trainer: loss {stats.get('loss', float('nan')):.4f}, sent {len(names)} tensors over NCCL", flush=True)
else:
    from vllm_check import ToyTask, check_against  # noqa: E402
    from flexmarl_hpc.rollout.base import GenRequest
    from flexmarl_hpc.rollout.vllm_engine import VLLMEngine
    task = ToyTask()
    engine = VLLMEngine({"a": args}, task, RolloutConfig(backend="vllm", max_batch=32))
    engine.load_weights("a", 0, init)
    got = {}
    for k in names:
        buf = torch.empty(init[k].shape, dtype=torch.float32, device="cuda")
        nccl.broadcast(buf, src=0)
        got[k] = buf
    torch.cuda.synchronize()
    engine.load_weights("a", 1, got)
    moved = max(float((got[k].cpu() - init[k]).abs().max()) for k in names)
    assert moved > 0, "weights did not change after a training step"
    model = CausalLM(args)
    model.load_state_dict({k: v.cpu() for k, v in got.items()}, strict=False)
    reqs = [GenRequest(f"s{i}", [1, 3 + i, 5], 100 + i, 6, turn=i % 2) for i in range(16)]
    check_against(model.eval(), engine, "a", task, reqs, SamplingParams(temperature=1.0),
                  "vllm on NCCL-synced weights", tol=2e-3)      # GPU matmuls may use TF32
    engine.close()
    print(f"gpu megatron->vllm ok (weights moved by up to {moved:.2e})", flush=True)
world.Barrier()
