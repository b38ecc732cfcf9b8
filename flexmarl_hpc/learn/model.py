"""A Llama/Qwen2-family decoder (RMSNorm, SwiGLU, RoPE, GQA) with HF parameter names.

The state dict keys are exactly those of HF `LlamaForCausalLM` (`model.layers.0.self_attn.q_proj.weight`,
...), so the same tensors load into megatron-core (through flexmarl_hpc.learn.convert) and vLLM.
The forward pass takes an optional KV cache for batched incremental decoding with left
padding; without a cache it is the plain training forward.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# the architecture and its config.json reader are torch-free (config/hf_config.py): the config
# loader reads a checkpoint's shapes on a login node with them
from flexmarl_hpc.config.hf_config import SUPPORTED_MODEL_TYPES, ModelArgs, load_hf_args  # noqa: F401


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).type_as(x) * self.weight


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Per-pair rotation frequencies; with Llama-3 scaling, long wavelengths are slowed down by
    `factor`, short ones kept, and the band between interpolated (as HF and megatron-core do)."""
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.int64).float() / args.head_dim))
    if args.rope_llama3 is None:
        return inv
    factor, lo, hi, orig = args.rope_llama3
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > orig / lo, inv / factor, inv)
    smooth = (orig / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= orig / hi) & (wavelen <= orig / lo)
    return torch.where(medium, smoothed, scaled)


def rope_tables(args: ModelArgs, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [B, T, head_dim] for integer positions [B, T] (HF rotate-half layout)."""
    inv = rope_inv_freq(args)
    ang = positions.float()[..., None] * inv
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


class KVCache:
    """Preallocated per-layer keys/values [B, kv_heads, max_len, head_dim] and a key mask."""

    def __init__(self, args: ModelArgs, batch: int, max_len: int, dtype=torch.float32):
        shape = (batch, args.num_kv_heads, max_len, args.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(args.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(args.num_layers)]
        self.key_mask = torch.zeros(batch, max_len, dtype=torch.bool)
        self.length = 0


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        hd = args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, args.num_heads * hd, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, args.num_kv_heads * hd, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, args.num_kv_heads * hd, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.num_heads * hd, args.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int):
        B, T, _ = x.shape
        a = self.args
        q = self.q_proj(x).view(B, T, a.num_heads, a.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            s = cache.length
            cache.k[layer][:, :, s:s + T] = k
            cache.v[layer][:, :, s:s + T] = v
            k, v = cache.k[layer][:, :, :s + T], cache.v[layer][:, :, :s + T]
        rep = a.num_heads // a.num_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, mask, cache, layer):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_eps)


class CausalLM(nn.Module):
    """`LlamaForCausalLM`-compatible module: `model.*` backbone plus `lm_head`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, std: float, generator: torch.Generator) -> None:
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                nn.init.ones_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                with torch.no_grad():
                    p.normal_(0.0, std, generator=generator)
        # scale residual projections by depth (GPT-2 style) so deep stacks start stable
        for layer in self.model.layers:
            with torch.no_grad():
                layer.self_attn.o_proj.weight.div_(math.sqrt(2 * self.args.num_layers))
                layer.mlp.down_proj.weight.div_(math.sqrt(2 * self.args.num_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: KVCache | None = None, logits_from: int = 0) -> torch.Tensor:
        """Logits [B, T - logits_from, V] of positions logits_from.. `attention_mask` [B, T]
        marks real tokens (padding may be anywhere).

        With a cache, `input_ids` are the next T tokens of every sequence; the mask then
        covers only those tokens and is appended to the cache's key mask.
        """
        B, T = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.bool)
        attention_mask = attention_mask.bool()
        if cache is None:
            key_mask, start = attention_mask, 0
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        else:
            start = cache.length
            cache.key_mask[:, start:start + T] = attention_mask
            key_mask = cache.key_mask[:, :start + T]
            positions = (key_mask.long().cumsum(-1) - 1).clamp(min=0)[:, start:]
        Tk = key_mask.shape[1]
        causal = torch.ones(T, Tk, dtype=torch.bool).tril(diagonal=start)
        mask = causal[None] & key_mask[:, None, :]
        # a fully masked row (a padding query) would give NaN; let it see itself
        diag = torch.zeros(T, Tk, dtype=torch.bool)
        diag[torch.arange(T), start + torch.arange(T)] = True
        mask = mask | diag[None]
        cos, sin = rope_tables(self.args, positions)
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask[:, None], cache, i)
        if cache is not None:
            cache.length = start + T
        return self.lm_head(self.model.norm(x[:, logits_from:]))


def build_model(args: ModelArgs, seed: int, std: float = 0.02) -> CausalLM:
    model = CausalLM(args)
    model.init_weights(std, torch.Generator().manual_seed(seed))
    return model


def hf_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor of the model (a tied lm_head left out), no data."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in hf_state_dict(CausalLM(args)).items()}


def init_tensors(args: ModelArgs, seed: int, std: float = 0.02, device=None):
    """Yield (HF name, tensor) of `build_model(args, seed, std)` one tensor at a time, bit-equal
    to it (the same generator draws in the same order), so a sharded trainer can take its
    slices of a random init without the full model ever existing (the largest tensor does)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        names = [(n, tuple(p.shape)) for n, p in CausalLM(args).named_parameters()]
    for name, shape in names:
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            t = torch.ones(shape)
        elif name.endswith("bias"):
            t = torch.zeros(shape)
        else:
            t = torch.empty(shape).normal_(0.0, std, generator=gen)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                t.div_(math.sqrt(2 * args.num_layers))
        yield name, (t if device is None else t.to(device))


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """HF-named tensors; a tied lm_head is left out, as HF does."""
    sd = model.state_dict()
    if model.args.tie_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def save_hf_checkpoint(model: CausalLM, folder: str | Path) -> None:
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf_state_dict(model).items()},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(model.args.to_hf_config(), indent=2))


def load_hf_checkpoint(folder: str | Path) -> CausalLM:
    """Load a local HF Llama/Qwen2 checkpoint (config.json + *.safetensors)."""
    from safetensors.torch import load_file
    folder = Path(folder)
    args = load_hf_args(folder)
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    sd: dict[str, torch.Tensor] = {}
    for s in shards:
        sd.update(load_file(str(s)))
    model = CausalLM(args)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (args.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{folder}: checkpoint does not match config.json: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model
