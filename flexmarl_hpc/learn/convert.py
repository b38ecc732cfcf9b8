"""The one converter between HF-named tensors and megatron-core's GPTModel layout.

HF (Llama/Qwen2 names, as flexmarl_hpc.learn.model)      megatron-core (local layer spec)
  model.embed_tokens.weight [V, H]                   embedding.word_embeddings.weight [Vp/tp, H]
  layers.i.self_attn.{q,k,v}_proj.weight             decoder.layers.j.self_attention.linear_qkv.weight:
                                                       per query group g: [q heads of g | k_g | v_g],
                                                       groups split over TP ranks
  layers.i.self_attn.{q,k,v}_proj.bias (qkv_bias)    ...linear_qkv.bias, grouped like the weight rows
  layers.i.self_attn.o_proj.weight [H, nh*hd]        ...self_attention.linear_proj.weight [H, nh*hd/tp]
  layers.i.mlp.{gate,up}_proj.weight [F, H]          ...mlp.linear_fc1.weight [2F/tp, H] = [gate_r; up_r]
  layers.i.mlp.down_proj.weight [H, F]               ...mlp.linear_fc2.weight [H, F/tp]
  layers.i.input_layernorm / post_attention_layernorm  ...input_layernorm / pre_mlp_layernorm
  model.norm.weight                                  decoder.final_layernorm.weight (last PP stage)
  lm_head.weight (untied) [V, H]                     output_layer.weight [Vp/tp, H] (last PP stage)

Layer i lives on PP stage i // (L / pp) as local layer j = i % (L / pp). The vocabulary
is padded to Vp rows (`padded_vocab`), a function of the model alone, never of TP, so a
dist_checkpointing checkpoint reshards to any other TP; padding rows are zero and are cut
off on the way back. Any tensor in a parameter's layout converts the same way (Adam
moments). Pure tensor code: both directions are tested to round-trip bit for bit
(tests/test_convert.py).
"""
from __future__ import annotations

import math

import torch

from flexmarl_hpc.learn.model import ModelArgs


def max_tensor_parallel(args: ModelArgs) -> int:
    """Every TP size this model splits over divides this: megatron shards whole query groups
    (and heads, and FFN rows) over TP ranks."""
    return math.gcd(args.num_heads, args.num_kv_heads, args.intermediate_size)


def padded_vocab(args: ModelArgs) -> int:
    """Rows of megatron's embedding / output layer: vocab_size rounded up to a multiple of
    lcm(128, max_tensor_parallel(args)). It does not depend on the TP size in use (megatron's
    own 128 x TP rule does), so the global shape that dist_checkpointing stores is the same at
    every TP and a checkpoint saved at one TP loads at another, for any vocab size; and every
    legal TP divides it, as VocabParallelEmbedding needs. 128 is megatron's default
    make_vocab_size_divisible_by (GEMM-friendly shards); the lcm only grows it for
    non-power-of-two TP (e.g. 3 KV heads, SmolLM2-135M: TP3 is legal, lcm = 384), at a cost
    of under lcm rows."""
    step = math.lcm(128, max_tensor_parallel(args))
    return -(-args.vocab_size // step) * step


def _layers_of(args: ModelArgs, pp_rank: int, pp_size: int) -> range:
    if args.num_layers % pp_size:
        raise ValueError(f"{args.num_layers} layers do not split over pipeline_parallel={pp_size}")
    per = args.num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def _vocab_shard(w: torch.Tensor, args: ModelArgs, tp_rank: int, tp_size: int) -> torch.Tensor:
    vp = padded_vocab(args)
    full = torch.zeros(vp, w.shape[1], dtype=w.dtype)
    full[:w.shape[0]] = w
    return full.chunk(tp_size, 0)[tp_rank].clone()


def hf_to_megatron(hf: dict[str, torch.Tensor], args: ModelArgs, tp_rank: int = 0, tp_size: int = 1,
                   pp_rank: int = 0, pp_size: int = 1) -> dict[str, torch.Tensor]:
    """The megatron state dict of one (TP rank, PP stage) shard."""
    nh, ng, hd, H = args.num_heads, args.num_kv_heads, args.head_dim, args.hidden_size
    if max_tensor_parallel(args) % tp_size:
        raise ValueError(f"heads {nh}/{ng} and ffn {args.intermediate_size} must divide by tp={tp_size}")
    out: dict[str, torch.Tensor] = {}
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    if first:
        out["embedding.word_embeddings.weight"] = _vocab_shard(hf["model.embed_tokens.weight"], args,
                                                               tp_rank, tp_size)
    for j, i in enumerate(_layers_of(args, pp_rank, pp_size)):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{j}."
        q = hf[src + "self_attn.q_proj.weight"].view(ng, nh // ng * hd, H)
        k = hf[src + "self_attn.k_proj.weight"].view(ng, hd, H)
        v = hf[src + "self_attn.v_proj.weight"].view(ng, hd, H)
        qkv = torch.cat([q, k, v], 1).chunk(tp_size, 0)[tp_rank]
        out[dst + "self_attention.linear_qkv.weight"] = qkv.reshape(-1, H).clone()
        if args.qkv_bias:                     # same grouping as the weight rows
            qb = hf[src + "self_attn.q_proj.bias"].view(ng, nh // ng * hd)
            kb = hf[src + "self_attn.k_proj.bias"].view(ng, hd)
            vb = hf[src + "self_attn.v_proj.bias"].view(ng, hd)
            out[dst + "self_attention.linear_qkv.bias"] = \
                torch.cat([qb, kb, vb], 1).chunk(tp_size, 0)[tp_rank].reshape(-1).clone()
        out[dst + "self_attention.linear_proj.weight"] = \
            hf[src + "self_attn.o_proj.weight"].chunk(tp_size, 1)[tp_rank].clone()
        gate = hf[src + "mlp.gate_proj.weight"].chunk(tp_size, 0)[tp_rank]
        up = hf[src + "mlp.up_proj.weight"].chunk(tp_size, 0)[tp_rank]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up], 0).clone()
        out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"].chunk(tp_size, 1)[tp_rank].clone()
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"].clone()
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"].clone()
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        head = hf["model.embed_tokens.weight"] if args.tie_embeddings else hf["lm_head.weight"]
        if not args.tie_embeddings or pp_size > 1:
            out["output_layer.weight"] = _vocab_shard(head, args, tp_rank, tp_size)
    return out


def megatron_to_hf(shards: list[list[dict[str, torch.Tensor]]], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Full HF tensors from shards[pp_rank][tp_rank] (the inverse of hf_to_megatron)."""
    pp_size, tp_size = len(shards), len(shards[0])
    nh, ng, hd, H, V = args.num_heads, args.num_kv_heads, args.head_dim, args.hidden_size, args.vocab_size
    out: dict[str, torch.Tensor] = {}
    vp = padded_vocab(args)

    def cat_vocab(key: str, pp: int) -> torch.Tensor:
        full = torch.cat([s[key] for s in shards[pp]], 0)
        if full.shape[0] != vp:
            raise ValueError(f"{key}: {full.shape[0]} rows over TP{tp_size}, expected the padded vocab {vp}")
        return full[:V].clone()
    out["model.embed_tokens.weight"] = cat_vocab("embedding.word_embeddings.weight", 0)
    for pp in range(pp_size):
        tps = shards[pp]
        for j, i in enumerate(_layers_of(args, pp, pp_size)):
            src, dst = f"decoder.layers.{j}.", f"model.layers.{i}."
            qkv = torch.cat([t[src + "self_attention.linear_qkv.weight"].view(ng // tp_size, -1, H)
                             for t in tps], 0)
            q, k, v = qkv.split([nh // ng * hd, hd, hd], 1)
            out[dst + "self_attn.q_proj.weight"] = q.reshape(nh * hd, H).clone()
            out[dst + "self_attn.k_proj.weight"] = k.reshape(ng * hd, H).clone()
            out[dst + "self_attn.v_proj.weight"] = v.reshape(ng * hd, H).clone()
            if args.qkv_bias:
                b = torch.cat([t[src + "self_attention.linear_qkv.bias"].view(ng // tp_size, -1)
                               for t in tps], 0)
                qb, kb, vb = b.split([nh // ng * hd, hd, hd], 1)
                out[dst + "self_attn.q_proj.bias"] = qb.reshape(-1).clone()
                out[dst + "self_attn.k_proj.bias"] = kb.reshape(-1).clone()
                out[dst + "self_attn.v_proj.bias"] = vb.reshape(-1).clone()
            out[dst + "self_attn.o_proj.weight"] = torch.cat(
                [t[src + "self_attention.linear_proj.weight"] for t in tps], 1)
            fc1 = [t[src + "mlp.linear_fc1.weight"].chunk(2, 0) for t in tps]
            out[dst + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in fc1], 0)
            out[dst + "mlp.up_proj.weight"] = torch.cat([u for _, u in fc1], 0)
            out[dst + "mlp.down_proj.weight"] = torch.cat([t[src + "mlp.linear_fc2.weight"] for t in tps], 1)
            out[dst + "input_layernorm.weight"] = tps[0][src + "input_layernorm.weight"].clone()
            out[dst + "post_attention_layernorm.weight"] = tps[0][src + "pre_mlp_layernorm.weight"].clone()
    out["model.norm.weight"] = shards[-1][0]["decoder.final_layernorm.weight"].clone()
    if not args.tie_embeddings:
        out["lm_head.weight"] = cat_vocab("output_layer.weight", pp_size - 1)
    return out
