"""A checkpoint's config.json is the source of truth of its model's shapes.

    from flexmarl_hpc.config.checkpoint import resolve_checkpoints
    cfg = resolve_checkpoints(cfg, data)   # data: the YAML after overrides (which keys were set)

`load_config` runs it before `validate`, so every check (TP/PP divisibility, pool fits, bucket
rows) and every consumer of the config sees the shapes of the files, not ModelConfig's
defaults. A shape field set in the YAML (or an override) that disagrees with config.json is
refused by name; one left out takes the checkpoint's value. Torch-free (login nodes).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from flexmarl_hpc.config.schema import Config, ConfigError, ModelConfig
from flexmarl_hpc.config.hf_config import ModelArgs

SHAPE_KEYS = {
    "hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads", "intermediate_size": "intermediate_size",
    "max_seq_len": "max_position_embeddings", "rope_theta": "rope_theta", "rms_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings", "qkv_bias": "model_type",
}
"""ModelConfig field -> the config.json key it comes from (named in messages)."""
INT_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "max_position_embeddings")


def resolve_checkpoints(cfg: Config, data: dict) -> Config:
    """`cfg` with the shapes of `model` and of each `agents.<name>` that names a checkpoint
    taken from its config.json; ConfigError when a field set in `data` disagrees."""
    given = data.get("agents") if isinstance(data.get("agents"), dict) else {}
    model = _resolve(cfg.model, _keys(data.get("model")), "model")
    agents = {name: _resolve(m, _keys(given.get(name)), f"agents.{name}") for name, m in cfg.agents.items()}
    return dataclasses.replace(cfg, model=model, agents=agents)


def _keys(section: Any) -> set[str]:
    """The fields a YAML section (after overrides) sets explicitly."""
    return set(section) if isinstance(section, dict) else set()


def _resolve(m: ModelConfig, explicit: set[str], where: str) -> ModelConfig:
    if not m.checkpoint:
        return m
    path = Path(m.checkpoint) / "config.json"
    shapes = checkpoint_shapes(m.checkpoint, f"{where}.checkpoint")
    if _saved_before_resolution(m, explicit):
        explicit = set()
    for key, value in shapes.items():
        if key in explicit and getattr(m, key) != value:
            raise ConfigError(f"{where}.{key}: {getattr(m, key)!r} in the config, {value!r} in {path} "
                              f"({SHAPE_KEYS[key]}); leave it out to take the checkpoint's")
    return dataclasses.replace(m, **shapes)


def checkpoint_shapes(folder: str, where: str) -> dict[str, Any]:
    """ModelConfig's shape fields as the checkpoint's config.json gives them (typed as
    ModelConfig's, so a string where a number belongs is refused here, by name)."""
    args = _read_args(folder, where)
    types = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    out = {}
    for key in SHAPE_KEYS:
        value, tp = getattr(args, key), types[key]
        if tp == "float" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value).__name__ != tp:
            raise ConfigError(f"{where}: {Path(folder) / 'config.json'}: {SHAPE_KEYS[key]}: expected "
                              f"{tp}, got {value!r}")
        out[key] = value
    return out


def _read_args(folder: str, where: str) -> ModelArgs:
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise ConfigError(f"{where}: expected a local HF checkpoint folder, {folder!r} does not exist")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{where}: {path}: no config.json (expected a HF checkpoint folder)") from None
    except OSError as e:
        raise ConfigError(f"{where}: {path}: cannot read it ({e.strerror})") from None
    except ValueError as e:                          # JSON or UTF-8 errors
        raise ConfigError(f"{where}: {path}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{where}: {path}: expected a JSON object, got {type(hf).__name__}")
    for key in INT_KEYS:                             # before the reader does arithmetic on them
        if hf.get(key) is not None and (type(hf[key]) is not int or hf[key] < 1):
            raise ConfigError(f"{where}: {path}: {key}: expected an integer >= 1, got {hf[key]!r}")
    try:
        return ModelArgs.from_hf_config(hf)
    except KeyError as e:
        raise ConfigError(f"{where}: {path}: no {e.args[0]!r} (expected a Llama/Qwen2 config.json)") from None
    except (ValueError, TypeError) as e:            # the reader's refusals name the key
        raise ConfigError(f"{where}: {Path(folder)}: {e}") from None


def _saved_before_resolution(m: ModelConfig, explicit: set[str]) -> bool:
    """A run's resolved config.yaml (or HDF5 config_yaml) written before load_config read
    checkpoints states every field, its shapes at ModelConfig's defaults, which the runtime
    never used (it built the model from config.json): export and analysis of such a run take
    the checkpoint's shapes instead of refusing them."""
    every = {f.name for f in dataclasses.fields(ModelConfig)}
    default = ModelConfig()
    return explicit >= every and all(getattr(m, k) == getattr(default, k) for k in SHAPE_KEYS)
