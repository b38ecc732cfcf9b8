"""config -> objects on a rank: each agent's model, the rollout engine, the trainers, the
state mover (the task: workflows/build.py; where agents start: runtime/placement.py).

The only place that maps `backend` strings to classes; heavy backends are imported here
lazily so a torch-only job never imports megatron or vllm.
"""
from __future__ import annotations

import sys

from flexmarl_hpc.config.hf_config import ModelArgs, model_args
from flexmarl_hpc.config.plan import Plan
from flexmarl_hpc.config.schema import Config
from flexmarl_hpc.learn.model import CausalLM, build_model, load_hf_checkpoint
from flexmarl_hpc.learn.sampling import sample_seed
from flexmarl_hpc.runtime.placement import initial_placement
from flexmarl_hpc.workflows.base import Task


def initial_model(cfg: Config, task: Task, agent: str) -> CausalLM:
    """Version 0 of an agent: a local HF checkpoint, or random init seeded by (seed, agent)."""
    m = cfg.model_for(agent)
    if m.checkpoint:
        return load_hf_checkpoint(m.checkpoint)
    seed = sample_seed(cfg.run.seed, agent, 0, "init")
    return build_model(ModelArgs.from_config(m, len(task.vocab)), seed, m.init_std)


def _cpu_only(what: str, device: str) -> None:
    """The built-in torch engine and trainer run on the CPU (their tensors and reductions go
    through numpy/MPI): say so once instead of idling a bound GPU silently."""
    if device != "cpu" and what not in _WARNED:
        _WARNED.add(what)
        print(f"flexmarl_hpc: {what} is CPU-only; this rank's {device} stays idle "
              "(use the vllm / megatron backend on GPUs)", file=sys.stderr, flush=True)


_WARNED: set[str] = set()


def build_engine(plan: Plan, task: Task, device: str = "cpu", pool: int = 0):
    """This replica's engine, holding the models of the agents its pool may serve
    (plan.pools[pool]). `device` is the rank's binding (flexmarl_hpc.runtime.devices), already
    applied: vLLM sees only the replica's GPU block as cuda:0.. through CUDA_VISIBLE_DEVICES."""
    import dataclasses
    cfg, p = plan.cfg, plan.pools[pool]
    args_of = {agent: model_args(cfg, task, agent) for agent in cfg.agent_names if agent in p.agents}
    if cfg.rollout.backend == "vllm":
        from flexmarl_hpc.rollout.vllm_engine import VLLMEngine
        from flexmarl_hpc.config.gpu_memory import replica_sync_comms
        from flexmarl_hpc.runtime.weight_sync import wire_dtype
        # the pool's GPUs per replica are vLLM's tensor_parallel_size; its fraction leaves the
        # receive buffer and the sync communicators each worker joins after the engine started
        wire = wire_dtype(cfg.rollout.dtype, cfg.rollout.backend, cfg.weight_sync.backend)
        return VLLMEngine(args_of, task, dataclasses.replace(cfg.rollout, gpus_per_replica=p.gpus_per_replica),
                          gpu_memory_gb=p.gpu_memory_gb, bucket_bytes=receive_span(cfg, args_of.values(), wire),
                          sync_comms=len(replica_sync_comms(plan, pool)))
    from flexmarl_hpc.rollout.torch_engine import TorchEngine
    _cpu_only("rollout.backend=torch", device)
    return TorchEngine(args_of, task, cfg.rollout.max_batch)


def receive_span(cfg: Config, args_of, wire) -> int:
    """Bytes of a replica's receive buffer for models `args_of` (ModelArgs): the largest
    bucket or tensor sent in pieces at the wire dtype (weight_sync.SyncPlan.span: a split
    tensor's pieces land in place in it; with Qwen's 152,064-token vocabulary the embedding,
    1.56 GB in bf16, is larger than a 1 GiB bucket)."""
    import torch
    from flexmarl_hpc.learn.model import CausalLM
    from flexmarl_hpc.runtime.weight_sync import plan_buckets
    bucket, span = int(cfg.weight_sync.bucket_mb * 2**20), 0
    for args in args_of:
        with torch.device("meta"):
            layout = [(k, tuple(v.shape), torch.float32) for k, v in CausalLM(args).state_dict().items()]
        span = max([span] + [b.span for b in plan_buckets(layout, bucket, wire)])
    return span


def build_trainer(plan: Plan, task: Task, agent: str, group_comm, device: str = "cpu", group: int = 0):
    """One agent's trainer backend on this rank's group (`group`: its index, whose backend
    and TP/PP it uses), at version 0. `device`: the rank's binding, already the current CUDA
    device (megatron allocates on current_device())."""
    cfg, tcfg = plan.cfg, plan.trainers[group]
    if tcfg.backend == "megatron":
        # each rank reads / draws only its own shard, on its device (learn/weights.py)
        from flexmarl_hpc.trainer.megatron import MegatronTrainer
        return MegatronTrainer(model_args(cfg, task, agent), tcfg, group_comm, cfg.rollout.temperature,
                               init=weight_source(cfg, agent))
    from flexmarl_hpc.trainer.torch_trainer import TorchTrainer
    _cpu_only("trainer.backend=torch", device)
    return TorchTrainer(initial_model(cfg, task, agent), tcfg, group_comm, cfg.rollout.temperature)


def weight_source(cfg: Config, agent: str):
    """Version 0 of an agent as a shard-by-shard source: the same weights as initial_model."""
    from flexmarl_hpc.learn.weights import WeightSource
    m = cfg.model_for(agent)
    return WeightSource(seed=sample_seed(cfg.run.seed, agent, 0, "init"), std=m.init_std,
                        checkpoint=str(m.checkpoint or ""))


def build_mover(plan: Plan, task: Task, world, group_index: int, group_comm, device: str = "cpu"):
    """This rank's StateMover holding the group's initial agents (see initial_placement):
    the first resident, the others built once and swapped out at once into host buffers
    that later swaps reuse."""
    from flexmarl_hpc.runtime.state_swap import StateMover
    mover = StateMover(world, group_comm, group_index, plan.layout.group_ranks, {},
                       lambda agent: build_trainer(plan, task, agent, group_comm, device, group_index))
    for agent, loc in initial_placement(plan.groups, plan.cfg.agent_names).items():
        if loc.group != group_index:
            continue
        tr = build_trainer(plan, task, agent, group_comm, device, group_index)
        if loc.resident:
            mover.trainers[agent] = tr
        else:
            mover.park(agent, tr)
    return mover
