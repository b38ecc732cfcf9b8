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
(tests/unit/test_convert.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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


def dict_reader(hf: dict[str, torch.Tensor]):
    """A `megatron_shard` reader over full HF tensors in memory."""
    def read(name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        t = hf[name]
        return t if dim is None else t.narrow(dim, start, stop - start)
    return read


def _vocab_shard(read, name: str, args: ModelArgs, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rows [r*Vp/tp, (r+1)*Vp/tp) of the padded vocabulary: only the real rows are read."""
    rows = padded_vocab(args) // tp_size
    lo, hi = tp_rank * rows, min((tp_rank + 1) * rows, args.vocab_size)
    got = read(name, 0, lo, hi) if hi > lo else None
    out = torch.zeros(rows, args.hidden_size, dtype=got.dtype if got is not None else torch.float32,
                      device=got.device if got is not None else None)
    if got is not None:
        out[:hi - lo] = got
    return out


def hf_to_megatron(hf: dict[str, torch.Tensor], args: ModelArgs, tp_rank: int = 0, tp_size: int = 1,
                   pp_rank: int = 0, pp_size: int = 1) -> dict[str, torch.Tensor]:
    """The megatron state dict of one (TP rank, PP stage) shard, from full HF tensors."""
    return megatron_shard(dict_reader(hf), args, tp_rank, tp_size, pp_rank, pp_size)


def megatron_shard(read, args: ModelArgs, tp_rank: int = 0, tp_size: int = 1,
                   pp_rank: int = 0, pp_size: int = 1) -> dict[str, torch.Tensor]:
    """The megatron state dict of one (TP rank, PP stage) shard. `read(name, dim, start, stop)`
    returns rows/columns [start, stop) of HF tensor `name` along `dim` (dim None: all of it),
    so a reader over a safetensors file (safe_open's get_slice) reads only this rank's part:
    a TP shard needs contiguous ranges of each HF tensor (query groups are contiguous)."""
    nh, ng, hd, H = args.num_heads, args.num_kv_heads, args.head_dim, args.hidden_size
    if max_tensor_parallel(args) % tp_size:
        raise ValueError(f"heads {nh}/{ng} and ffn {args.intermediate_size} must divide by tp={tp_size}")
    out: dict[str, torch.Tensor] = {}
    g0, g1 = tp_rank * ng // tp_size, (tp_rank + 1) * ng // tp_size     # this rank's query groups
    qg = nh // ng * hd                                                    # q rows per group
    F = args.intermediate_size // tp_size
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = _vocab_shard(read, "model.embed_tokens.weight", args,
                                                               tp_rank, tp_size)
    for j, i in enumerate(_layers_of(args, pp_rank, pp_size)):
        src, dst = f"model.layers.{i}.self_attn.", f"decoder.layers.{j}."
        parts = [read(src + "q_proj.weight", 0, g0 * qg, g1 * qg).reshape(g1 - g0, qg, H),
                 read(src + "k_proj.weight", 0, g0 * hd, g1 * hd).reshape(g1 - g0, hd, H),
                 read(src + "v_proj.weight", 0, g0 * hd, g1 * hd).reshape(g1 - g0, hd, H)]
        out[dst + "self_attention.linear_qkv.weight"] = torch.cat(parts, 1).reshape(-1, H)
        if args.qkv_bias:                     # same grouping as the weight rows
            parts = [read(src + "q_proj.bias", 0, g0 * qg, g1 * qg).reshape(g1 - g0, qg),
                     read(src + "k_proj.bias", 0, g0 * hd, g1 * hd).reshape(g1 - g0, hd),
                     read(src + "v_proj.bias", 0, g0 * hd, g1 * hd).reshape(g1 - g0, hd)]
            out[dst + "self_attention.linear_qkv.bias"] = torch.cat(parts, 1).reshape(-1)
        cols = nh * hd // tp_size
        out[dst + "self_attention.linear_proj.weight"] = \
            read(src + "o_proj.weight", 1, tp_rank * cols, (tp_rank + 1) * cols).clone()
        mlp = f"model.layers.{i}.mlp."
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([read(mlp + "gate_proj.weight", 0, tp_rank * F, (tp_rank + 1) * F),
                                                        read(mlp + "up_proj.weight", 0, tp_rank * F, (tp_rank + 1) * F)], 0)
        out[dst + "mlp.linear_fc2.weight"] = read(mlp + "down_proj.weight", 1, tp_rank * F, (tp_rank + 1) * F).clone()
        out[dst + "input_layernorm.weight"] = read(f"model.layers.{i}.input_layernorm.weight", None, 0, 0).clone()
        out[dst + "pre_mlp_layernorm.weight"] = \
            read(f"model.layers.{i}.post_attention_layernorm.weight", None, 0, 0).clone()
    if pp_rank == pp_size - 1:
        out["decoder.final_layernorm.weight"] = read("model.norm.weight", None, 0, 0).clone()
        head = "model.embed_tokens.weight" if args.tie_embeddings else "lm_head.weight"
        if not args.tie_embeddings or pp_size > 1:
            out["output_layer.weight"] = _vocab_shard(read, head, args, tp_rank, tp_size)
    return out


def _meta_shard(args: ModelArgs, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, reads=None):
    from flexmarl_hpc.learn.model import hf_shapes
    shapes = hf_shapes(args)

    def record(name, dim=None, start=0, stop=0):
        if reads is not None:
            reads.setdefault(name, []).append((dim, start, stop))
        shape = list(shapes[name])
        if dim is not None:
            shape[dim] = stop - start
        return torch.empty(shape, device="meta")
    with torch.device("meta"):
        return megatron_shard(record, args, tp_rank, tp_size, pp_rank, pp_size)


def shard_reads(args: ModelArgs, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int
                ) -> dict[str, list[tuple[int | None, int, int]]]:
    """The HF slices one shard reads, {name: [(dim, start, stop), ...]}: `megatron_shard`
    run on a recording reader over meta tensors (no data)."""
    reads: dict[str, list[tuple[int | None, int, int]]] = {}
    _meta_shard(args, tp_rank, tp_size, pp_rank, pp_size, reads)
    return reads


def sync_order(args: ModelArgs, tp_size: int, pp_rank: int, pp_size: int
               ) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """The weight sync's stream order of PP stage `pp_rank`: its megatron parameters in
    converter order, each with the (HF name, shape) pairs `megatron_param_to_hf` makes of it.
    Pure (meta tensors): the sender streams in this order, the receivers' plan is made of it."""
    shard = _meta_shard(args, 0, tp_size, pp_rank, pp_size)
    order = []
    with torch.device("meta"):
        for name, t in shard.items():
            tps = [t] * (tp_size if tp_split_dim(name) is not None else 1)
            order.append((name, [(k, tuple(v.shape)) for k, v in megatron_param_to_hf(name, tps, args, pp_rank,
                                                                                      pp_size)]))
    return order


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


def megatron_param_to_hf(name: str, tps: list[torch.Tensor], args: ModelArgs, pp_rank: int, pp_size: int
                         ) -> list[tuple[str, torch.Tensor]]:
    """One megatron parameter of PP stage `pp_rank`, given its TP shards (in TP order; one
    shard for a replicated norm), as the HF tensors it holds: the per-parameter form of
    `megatron_to_hf` that the weight sync streams with (one parameter in memory at a time).
    A tied output layer (PP > 1) is a copy of the embedding: nothing."""
    nh, ng, hd, H, V = args.num_heads, args.num_kv_heads, args.head_dim, args.hidden_size, args.vocab_size
    tp = len(tps)
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", torch.cat(tps, 0)[:V])]
    if name == "output_layer.weight":
        return [] if args.tie_embeddings else [("lm_head.weight", torch.cat(tps, 0)[:V])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", tps[0])]
    _, _, j, rest = name.split(".", 3)
    i = _layers_of(args, pp_rank, pp_size)[int(j)]
    dst = f"model.layers.{i}."
    if rest == "self_attention.linear_qkv.weight":
        q, k, v = torch.cat([t.view(ng // tp, -1, H) for t in tps], 0).split([nh // ng * hd, hd, hd], 1)
        return [(dst + "self_attn.q_proj.weight", q.reshape(nh * hd, H)),
                (dst + "self_attn.k_proj.weight", k.reshape(ng * hd, H)),
                (dst + "self_attn.v_proj.weight", v.reshape(ng * hd, H))]
    if rest == "self_attention.linear_qkv.bias":
        q, k, v = torch.cat([t.view(ng // tp, -1) for t in tps], 0).split([nh // ng * hd, hd, hd], 1)
        return [(dst + f"self_attn.{x}_proj.bias", t.reshape(-1)) for x, t in zip("qkv", (q, k, v))]
    if rest == "mlp.linear_fc1.weight":
        halves = [t.chunk(2, 0) for t in tps]
        return [(dst + "mlp.gate_proj.weight", torch.cat([g for g, _ in halves], 0)),
                (dst + "mlp.up_proj.weight", torch.cat([u for _, u in halves], 0))]
    simple = {"self_attention.linear_proj.weight": ("self_attn.o_proj.weight", 1),
              "mlp.linear_fc2.weight": ("mlp.down_proj.weight", 1),
              "input_layernorm.weight": ("input_layernorm.weight", None),
              "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", None)}
    if rest not in simple:
        raise ValueError(f"megatron parameter {name!r}: no HF counterpart known")
    hf, dim = simple[rest]
    return [(dst + hf, tps[0] if dim is None else torch.cat(tps, dim))]


def tp_split_dim(name: str) -> int | None:
    """The dimension a megatron parameter is split along over TP ranks (None: replicated)."""
    if name.endswith("layernorm.weight"):
        return None
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return 0


@dataclass(frozen=True)
class RowSource:
    """Rows [lo, hi) of TP rank `rank`'s shard of a megatron parameter, which are rows
    [out_lo, out_hi) of a row range of an HF tensor: all its columns (`col` None), or, for a
    parameter split along dim 1, the rank's block of columns (`col` = the rank)."""
    rank: int
    lo: int
    hi: int
    out_lo: int
    out_hi: int
    col: int | None = None


def _blocks(first: int, stop: int, size: int, where) -> list[RowSource]:
    """HF rows [first, stop) of a tensor made of blocks of `size` rows, block g being rows
    [start, start + size) of TP rank r's shard, (r, start) = where(g)."""
    out = []
    for g in range(first // size, -(-stop // size)):
        a, b = max(first, g * size), min(stop, (g + 1) * size)
        rank, start = where(g)
        out.append(RowSource(rank, start + a - g * size, start + b - g * size, a - first, b - first))
    return out


def hf_row_sources(name: str, hf_name: str, args: ModelArgs, tp: int, first: int, stop: int
                   ) -> list[RowSource]:
    """Where rows [first, stop) of HF tensor `hf_name` (one of what megatron parameter `name`
    converts to, `megatron_param_to_hf`) lie in the parameter's TP shards: the inverse of
    `megatron_shard`'s layout, per row range, so that a sync gathers a bucket-sized range at
    a time and never the whole parameter. Vocab and FFN rows are contiguous per rank, q/k/v
    rows per query group (a rank holds whole groups, [q | k | v] each); a parameter split
    along dim 1 (o_proj, down_proj) gives every rank's same rows, its column block each."""
    nh, ng, hd = args.num_heads, args.num_kv_heads, args.head_dim
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        rows = padded_vocab(args) // tp
        return _blocks(first, stop, rows, lambda g: (g, 0))
    rest = name.split(".", 3)[-1]
    if rest.startswith("self_attention.linear_qkv."):
        qg, per = nh // ng * hd, ng // tp                  # q rows of a group, groups of a rank
        part = hf_name.rsplit(".", 2)[-2][0]               # q_proj / k_proj / v_proj
        size, off = {"q": (qg, 0), "k": (hd, qg), "v": (hd, qg + hd)}[part]
        return _blocks(first, stop, size, lambda g: (g // per, (g % per) * (qg + 2 * hd) + off))
    if rest == "mlp.linear_fc1.weight":
        f = args.intermediate_size // tp
        half = 0 if hf_name.endswith("gate_proj.weight") else f
        return _blocks(first, stop, f, lambda g: (g, half))
    if tp_split_dim(name) == 1:
        return [RowSource(r, first, stop, 0, stop - first, r) for r in range(tp)]
    return [RowSource(0, first, stop, 0, stop - first)]    # replicated (norms): rank 0's
