"""TrainerConfig + ModelArgs -> megatron's TransformerConfig, DDP and optimizer configs.

Pure functions of the configs (and of whether CUDA / Transformer Engine are present), so a
test inspects what a bf16 GPU run would build without a GPU.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from flexmarl_hpc.config.schema import TrainerConfig
from flexmarl_hpc.learn.model import ModelArgs
from flexmarl_hpc.trainer.megatron.dist import CUDA


def resolve_precision(cfg: TrainerConfig, cuda: bool = CUDA) -> str:
    """"auto" -> bf16 on GPU (tensor cores), fp32 on CPU."""
    if cfg.precision == "auto":
        return "bf16" if cuda else "fp32"
    return cfg.precision


def pipeline_microbatches(cfg: TrainerConfig) -> int:
    if cfg.pipeline_microbatches:
        return cfg.pipeline_microbatches
    return 2 * cfg.pipeline_parallel if cfg.pipeline_parallel > 1 else 1


def recompute_kwargs(cfg: TrainerConfig) -> dict:
    """trainer.recompute* -> TransformerConfig's recompute fields. full: every layer's input is
    kept and the layer recomputed in backward, grouped by recompute_method / _num_layers (a
    sequence's activations then cost one layer's, not num_layers'); selective: only the
    core attention (megatron's default recompute_modules), whose T x T scores dominate at
    long sequences and are cheap to recompute; megatron wants no method or count with it."""
    if cfg.recompute == "none":
        return {}
    if cfg.recompute == "selective":
        return {"recompute_granularity": "selective"}
    return {"recompute_granularity": "full", "recompute_method": cfg.recompute_method,
            "recompute_num_layers": cfg.recompute_num_layers}


def transformer_config(args: ModelArgs, cfg: TrainerConfig, cuda: bool = CUDA):
    from megatron.core.transformer.transformer_config import TransformerConfig
    bf16 = resolve_precision(cfg, cuda) == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_heads,
        num_query_groups=args.num_kv_heads, ffn_hidden_size=args.intermediate_size,
        kv_channels=args.head_dim, normalization="RMSNorm", layernorm_epsilon=args.rms_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=args.qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=cfg.tensor_parallel, pipeline_model_parallel_size=cfg.pipeline_parallel,
        bf16=bf16, pipeline_dtype=dtype, params_dtype=dtype, **recompute_kwargs(cfg),
        # the weights come from `init` right after construction, but megatron's init also tags
        # TP-sharded parameters (tensor_model_parallel, ...), which grad-norm and checkpoints
        # rely on: keep it (under fork_rng, so the caller's RNG stream is untouched)
        perform_initialization=True, use_cpu_initialization=not cuda,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False)


def ddp_config(cfg: TrainerConfig):
    from megatron.core.distributed import DistributedDataParallelConfig
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True,
        overlap_grad_reduce=cfg.overlap_grad_reduce, overlap_param_gather=cfg.overlap_param_gather)


def optimizer_config(cfg: TrainerConfig, cuda: bool = CUDA):
    """Adam (torch's AdamW on CPU) in the DistributedOptimizer; with bf16 the optimizer keeps
    fp32 main params (main_params_dtype) and fp32 moments, the model holds bf16 copies."""
    from megatron.core.optimizer import OptimizerConfig
    bf16 = resolve_precision(cfg, cuda) == "bf16"
    return OptimizerConfig(
        optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.betas[0],
        adam_beta2=cfg.betas[1], adam_eps=1e-8, clip_grad=cfg.grad_clip, use_distributed_optimizer=True,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        main_params_dtype=torch.float32, main_grads_dtype=torch.float32,
        exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32)


LOCAL_SPEC_NOTICE = (
    "megatron: transformer_engine is not importable, so the trainer builds megatron's local layer "
    "spec: unfused attention, O(seq_len^2) activation memory per layer; install Transformer Engine "
    "(the GPU extra) for long sequences, or set trainer.recompute")


def use_te(cuda: bool = CUDA, notify: Callable[[str], None] | None = None) -> bool:
    """Which layer spec the trainer builds: True for Transformer Engine's (fused attention
    and fused linear+norm kernels: what long sequences need), False for megatron's local
    one. TE only with CUDA (its kernels are CUDA-only: on CPU the local spec is the design, no
    notice) and only where `import transformer_engine` works; a GPU rank without it falls
    back to local and says so once through `notify` (LOCAL_SPEC_NOTICE). hf_state's parameter
    names follow the same answer."""
    if not cuda:
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        if notify is not None:
            notify(LOCAL_SPEC_NOTICE)
        return False
    return True


def layer_spec(te: bool):
    """megatron's layer spec for `use_te`'s answer."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    if te:
        return specs.get_gpt_layer_with_transformer_engine_spec()
    return specs.get_gpt_layer_local_spec(normalization="RMSNorm")
