"""What a GPU rank holds beyond its tensors, for `simulate memory` (sim/memory.py) and
the vLLM memory fraction (rollout/vllm_engine.memory_fraction).

The fake-tensor run counts tensors; on a GPU a rank also holds a CUDA context, each NCCL
communicator's buffers, and the caching allocator's rounding and fragmentation. Each
allowance here is a constant with its source; the communicators are counted per rank from
the config's layout (`trainer_comms`, `replica_sync_comms`). Pure: no torch, no MPI.

    comms = trainer_comms(plan, g, group_rank)           # ["tensor parallel", "sync p14", ...]
    extra = allowances(tensor_bytes, len(comms))         # Allowances(context, nccl, fragmentation)
"""
from __future__ import annotations

from dataclasses import dataclass

from flexmarl_hpc.config.plan import Plan

MiB = 2 ** 20

CUDA_CONTEXT_BYTES = 666_632_192
"""A process's CUDA context with eager module loading: 666,632,192 bytes measured by
PyTorch when it made lazy loading its default (pytorch/pytorch#86509: 287,047,680 bytes
lazy). Lazy loading (the default since CUDA 12.2) grows toward it as kernels load, so the
eager figure is the allowance. One per process: a trainer rank, a vLLM TP worker."""

NCCL_BUFFSIZE = 4 * MiB
"""NCCL_BUFFSIZE's default, the Simple protocol's buffer per channel and connection (NCCL
user guide, environment variables)."""
NCCL_LL128_BYTES = 120 * 640 * 8 * 8
"""The LL128 protocol's buffer per channel and connection: NCCL's DEFAULT_LL128_BUFFSIZE
(elements per thread 120 x 640 threads x NCCL_STEPS 8 x 8 B), 4.69 MiB."""
NCCL_LL_BYTES = 8 * 512 * 8 * 16
"""The LL protocol's buffer: DEFAULT_LL_BUFFSIZE (8 lines per thread x 512 threads x 8 steps
x 16 B), 0.5 MiB."""
NCCL_CHANNELS = 32
"""Channels a communicator opens on an NVLink node (NCCL's MAXCHANNELS of 32 for its
collectives; memory is linear in channels, NVIDIA/nccl#986)."""
NCCL_RING_PEERS = 2
"""Connections per channel: a ring has 2 (previous and next rank) whatever the scale
(NVIDIA/nccl#986)."""
NCCL_MEASURED_BYTES = 688 * 10 ** 6
"""One communicator of more than 2 GPUs after a 4 MB all-reduce, measured on 4 A100 with
NVLink (NVIDIA/nccl#964: 688 MB; 544 MB for 2 GPUs)."""


def nccl_comm_bytes() -> int:
    """Device bytes of one NCCL communicator: the larger of the buffers by NCCL's defaults
    (32 channels x 2 ring connections x (Simple + LL128 + LL) = 0.62 GB) and the measured 688
    MB, which also holds NCCL's work queues and proxy state."""
    formula = NCCL_CHANNELS * NCCL_RING_PEERS * (NCCL_BUFFSIZE + NCCL_LL128_BYTES + NCCL_LL_BYTES)
    return max(formula, NCCL_MEASURED_BYTES)


FRAGMENTATION = 0.10
"""The caching allocator's reserved bytes beyond the live tensors, as a fraction of the
tensor peak: it rounds each request to 512 B, carves requests over 1 MiB out of 20 MiB or
larger segments, and a freed block is reused only by a request that fits in it (PyTorch's
CUDA semantics, memory management). 10% is an allowance, not a measurement: the first GPU
run compares `torch.cuda.max_memory_reserved()` with the prediction (issue 36)."""


@dataclass(frozen=True)
class Allowances:
    """A GPU rank's bytes beyond its tensors."""
    context: int
    """The CUDA context (CUDA_CONTEXT_BYTES)."""
    nccl: int
    """Its NCCL communicators' buffers (count x nccl_comm_bytes())."""
    comms: int
    """How many communicators."""
    fragmentation: int
    """The allocator's rounding and fragmentation (FRAGMENTATION x the tensor bytes)."""

    @property
    def total(self) -> int:
        return self.context + self.nccl + self.fragmentation


def allowances(tensor_bytes: int, comms: int, context: bool = True) -> Allowances:
    """A GPU rank holding `tensor_bytes` of tensors and `comms` NCCL communicators;
    `context`: its CUDA context is counted here (False where another budget holds it)."""
    return Allowances(CUDA_CONTEXT_BYTES if context else 0, comms * nccl_comm_bytes(), comms,
                      int(FRAGMENTATION * tensor_bytes))


def trainer_comms(plan: Plan, g: int, rank: int) -> list[str]:
    """The NCCL communicators rank `rank` (of trainer group `g`) holds after a step and a
    checkpoint save. torch makes a group's communicator on its first collective, so a group
    counts where the rank uses it: the default group (dist_checkpointing's plan exchange),
    tensor parallel (TP > 1: the row-parallel all-reduces), data parallel (DP > 1: the
    distributed optimizer's reduce-scatter and all-gather), pipeline parallel (PP > 1: the
    stage send/recv), the embedding group (PP > 1 with tied embeddings: their grads
    all-reduced between first and last stage), and one weight-sync communicator per (group,
    pool) pair this rank sends on (config/sync_groups.py; NCCL on GPUs)."""
    grp = plan.groups[g]
    tp, pp = grp.tensor_parallel, grp.pipeline_parallel
    dp = grp.ranks // (tp * pp)
    out = ["default group"]
    out += ["tensor parallel"] * (tp > 1) + ["data parallel"] * (dp > 1) + ["pipeline parallel"] * (pp > 1)
    if pp > 1 and plan.cfg.model_for(grp.agents[0]).tie_embeddings:
        stage = rank * pp // grp.ranks
        out += ["embedding"] * (stage in (0, pp - 1))
    world = plan.layout.group_leader(g) + rank
    return out + [f"sync {plan.pools[s.pool].name}" for s in plan.sync_groups
                  if s.group == g and world in s.senders]


def replica_sync_comms(plan: Plan, p: int) -> list[str]:
    """The weight-sync communicators each TP worker of a pool-`p` replica joins after its
    engine started (one per trainer group that can feed the pool, config/sync_groups.py):
    outside vLLM's budget, which it measured before they existed."""
    return [f"sync {plan.groups[s.group].name}" for s in plan.sync_groups if s.pool == p]
