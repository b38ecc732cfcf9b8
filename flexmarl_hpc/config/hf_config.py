"""A decoder's architecture (ModelArgs) and a HF checkpoint's config.json read into it, torch-free.

    from flexmarl_hpc.config.hf_config import load_hf_args
    args = load_hf_args("models/smollm2-135m-instruct")     # reads config.json only

The model itself (torch) is learn/model.py, which re-exports these names. The config loader
(config/checkpoint.py) takes a checkpoint's shapes from here before any rank starts, so this
module imports no torch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from flexmarl_hpc.config.schema import Config, ModelConfig


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = True
    qkv_bias: bool = False
    rope_llama3: tuple[float, float, float, int] | None = None
    """Llama-3 RoPE scaling (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings); None: plain RoPE."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_config(cls, cfg: ModelConfig, vocab_size: int) -> "ModelArgs":
        return cls(vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                   cfg.intermediate_size, cfg.max_seq_len, cfg.rope_theta, cfg.rms_eps,
                   cfg.tie_embeddings, qkv_bias=cfg.qkv_bias)

    def to_hf_config(self) -> dict:
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_llama3 is not None:
            f, lo, hi, orig = self.rope_llama3
            rope = {"rope_type": "llama3", "rope_theta": self.rope_theta, "factor": f,
                    "low_freq_factor": lo, "high_freq_factor": hi,
                    "original_max_position_embeddings": orig}
        return {
            "architectures": ["Qwen2ForCausalLM" if self.qkv_bias else "LlamaForCausalLM"],
            "model_type": "qwen2" if self.qkv_bias else "llama",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_seq_len, "rope_theta": self.rope_theta,
            # transformers 5.x reads rope_parameters, 4.x rope_theta and rope_scaling
            "rope_parameters": rope, **({"rope_scaling": rope} if self.rope_llama3 else {}),
            "rms_norm_eps": self.rms_eps, "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu", "torch_dtype": "float32",
        }

    @classmethod
    def from_hf_config(cls, hf: dict) -> "ModelArgs":
        """Llama / Qwen2 config.json (transformers 4.x or 5.x). Every field that changes the
        math is either honoured or refused by name (ValueError), never ignored."""
        return _from_hf(cls, hf)


SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


def _from_hf(cls, hf: dict) -> ModelArgs:
    def refuse(key: str, why: str):
        raise ValueError(f"config.json: {key} = {hf.get(key)!r}: {why}")

    mt = hf.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        refuse("model_type", f"expected one of {list(SUPPORTED_MODEL_TYPES)} (a Llama/Qwen2 decoder)")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "only silu (SwiGLU) is implemented")
    for key in ("attention_bias", "mlp_bias"):          # Llama variants with extra biases
        if hf.get(key):
            refuse(key, "biases on these projections are not implemented")
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or []):
        refuse("use_sliding_window" if hf.get("use_sliding_window") else "layer_types",
               "sliding-window attention is not implemented (full attention only)")
    for key in ("attention_dropout", "hidden_dropout"):
        if float(hf.get(key) or 0) != 0:
            refuse(key, "dropout is not implemented; expected 0")
    if int(hf.get("pretraining_tp") or 1) != 1:
        refuse("pretraining_tp", "expected 1")
    heads = hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
        refuse("head_dim", f"expected hidden_size / num_attention_heads = {hf['hidden_size'] // heads}")
    theta, llama3 = _hf_rope(hf)
    return cls(hf["vocab_size"], hf["hidden_size"], hf["num_hidden_layers"], heads,
               hf.get("num_key_value_heads") or heads, hf["intermediate_size"],
               hf.get("max_position_embeddings", 2048), theta, hf.get("rms_norm_eps", 1e-6),
               hf.get("tie_word_embeddings", False), mt == "qwen2", llama3)


def _hf_rope(hf: dict) -> tuple[float, tuple | None]:
    """(rope_theta, llama3 scaling or None) from transformers 5.x `rope_parameters` or 4.x
    top-level `rope_theta` + `rope_scaling`."""
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rp = dict(hf.get(key) or {})
    theta = float(rp.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rp.get("rope_type", rp.get("type", "default"))
    partial = rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise ValueError(f"config.json: partial_rotary_factor = {partial}: only full rotary embeddings "
                         "are implemented")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"config.json: {key}.rope_type = {kind!r}: not implemented (expected default "
                         "or llama3)")
    try:
        llama3 = (float(rp["factor"]), float(rp["low_freq_factor"]), float(rp["high_freq_factor"]),
                  int(rp["original_max_position_embeddings"]))
    except KeyError as e:
        raise ValueError(f"config.json: {key}: llama3 scaling without {e.args[0]}") from None
    if not (llama3[0] >= 1 and 0 < llama3[1] < llama3[2] and llama3[3] > 0):
        raise ValueError(f"config.json: {key}: expected factor >= 1, 0 < low_freq_factor < "
                         f"high_freq_factor, original_max_position_embeddings > 0; got {rp}")
    return theta, llama3


def load_hf_args(folder: str | Path) -> ModelArgs:
    """The architecture of a local HF checkpoint, from its config.json alone (no weights read)."""
    cfg_path = Path(folder) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path}: expected an HF config.json in the checkpoint folder")
    return ModelArgs.from_hf_config(json.loads(cfg_path.read_text()))


def model_args(cfg: Config, task, agent: str) -> ModelArgs:
    """`agent`'s model: its checkpoint's config.json, else its model section with the
    vocabulary of `task` (anything with a `vocab`: workflows' Task)."""
    m = cfg.model_for(agent)
    if m.checkpoint:
        return load_hf_args(m.checkpoint)
    return ModelArgs.from_config(m, len(task.vocab))
