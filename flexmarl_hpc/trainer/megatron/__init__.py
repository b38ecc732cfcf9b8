"""megatron-core trainer backend: GPTModel with TP/PP/DP inside one trainer group.

The only package that imports megatron. Each trainer group is its own torch.distributed
world over exactly its ranks (dist.py), so several agents' groups coexist in one MPI job:
TP x PP x DP = trainer.ranks_per_group. The model is Llama/Qwen2-style (RMSNorm, SwiGLU,
RoPE with base rope_theta, GQA, tied or untied embeddings, biases only on QKV when
qkv_bias): megatron's local layer spec on CPU (through compat.py), the Transformer Engine
spec where TE is installed on a GPU; bf16 (Float16Module, fp32 main params) or fp32 per
trainer.precision (configs.py). It is wrapped in megatron's DDP with the DistributedOptimizer
(Adam; torch's AdamW on CPU). The loss is flexmarl_hpc.learn.grpo's, computed vocab-parallel on
the TP ranks, so both backends optimise the same function.

    dist.py       torch.distributed + parallel_state over one group; MPI byte helpers
    configs.py    TransformerConfig / DDP / optimizer configs (precision, recompute, overlap)
    hf_state.py   HF-named weights and Adam state <-> this rank's shards (state/load_state)
    dist_ckpt.py  dist_checkpointing save/load (reshardable) through checkpoint.py's manifests
    swap.py       offload/onload of this rank's storages (state swap)
    trainer.py    MegatronTrainer: the schedule, the vocab-parallel loss, the optimizer step
    compat.py     megatron-core on a CUDA-less torch (CPU, gloo)

Contract (same as TorchTrainer; tests/mpi/test_megatron.py checks it against TorchTrainer):
- `share(mb)` / `forward_backward(mb, scale, last)`: the share contract is trainer/base.py's;
  here it is the data-parallel replica's rows (dp_rank::dp, the same on all its TP and PP
  ranks), cut into trainer.pipeline_microbatches for the 1F1B schedule. Gradients of scale *
  sum-of-sample-losses accumulate. The returned stats have the same keys on every rank and
  sum over the group to the micro-batch totals.
- `optimizer_step()`: DP reduce-scatter + TP/PP reductions, clip, Adam step, param
  all-gather; nothing leaves the group. A weight sync streams (`sync_stream`: each HF
  tensor, or each bucket-sized row range of a larger one, assembled in HF layout on each PP
  stage's sender from the TP shards holding it, in place in the bucket being filled:
  runtime/weight_sync.py `Destination`); `named_weights()` is a collective full gather for tests
  and export.
- Built shard by shard: `init` is a learn/weights.WeightSource (an HF checkpoint read by
  this rank's slices, or a seeded random init) or full HF tensors (tests).
- `state()` / `load_state()`: HF-named full tensors in TorchTrainer's format, independent
  of TP/PP/DP. Both collective (every group rank calls them; `state()` gives each the full
  state). Meant for small models: at scale use `save_checkpoint`/`load_checkpoint`.
- `save_checkpoint(dir, keep)` / `load_checkpoint(dir)`: megatron dist_checkpointing of model
  and optimizer (fully reshardable format) as manifest-checked entries of flexmarl_hpc.store.checkpoint
  (atomic publish, newest valid on load). Collective. The job checkpoints megatron this way.
- `offload(host)` / `onload()` (swap.py, flexmarl_hpc.runtime.state_swap.Swappable): this rank's
  parameter, grad and optimizer storages to preallocated host buffers and back, no rebuild.
- `trainer.kl_coef > 0`: a frozen TP-sharded reference copy of the initial weights (PP = 1).

    trainer: {backend: megatron, ranks_per_group: 4, tensor_parallel: 2, pipeline_parallel: 1}
"""
from flexmarl_hpc.trainer.megatron.dist import init_group_distributed
from flexmarl_hpc.trainer.megatron.trainer import MegatronTrainer


def hf_weights_of_entry(entry, args, cfg):
    """HF-named weights of a dist_checkpointing entry (any layout), read by a one-rank
    TP1 x PP1 trainer on this process (export)."""
    import dataclasses
    from pathlib import Path

    from mpi4py import MPI
    one = dataclasses.replace(cfg, ranks_per_group=1, tensor_parallel=1, pipeline_parallel=1, kl_coef=0.0)
    tr = MegatronTrainer(args, one, MPI.COMM_SELF, 1.0)
    tr._load_entry(Path(entry))
    return tr.named_weights()


__all__ = ["MegatronTrainer", "hf_weights_of_entry", "init_group_distributed"]
