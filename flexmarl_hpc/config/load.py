"""YAML -> typed config: dotted overrides, field-named conversion errors, save, help text.

    from flexmarl_hpc.config.load import load_config, save_config
    cfg = load_config("configs/local.yaml", ["trainer.lr=1e-4", "run.steps=50"])
    plan = load_plan("configs/local.yaml", ["run.steps=50"])    # resolved once: config/plan.py
    save_config(cfg, cfg.output_dir / "config.yaml")

`load_config` takes each checkpoint's shapes from its config.json (config/checkpoint.py), then
validates (config/validate.py) before it returns: a config it hands out passed every pure check. Everything here runs on a login node before any rank starts.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from flexmarl_hpc.config.bounds import bound_of
from flexmarl_hpc.config.checkpoint import resolve_checkpoints
from flexmarl_hpc.config.plan import Plan, resolve
from flexmarl_hpc.config.schema import Config, ConfigError, join
from flexmarl_hpc.config.strict_yaml import YAMLLimitError, strict_load
from flexmarl_hpc.config.validate import validate


# ---------------------------------------------------------------------------------------
# Generic dataclass <-> dict conversion with field-named errors
# ---------------------------------------------------------------------------------------
def from_dict(cls: type, data: Any, where: str = "") -> Any:
    """Build dataclass `cls` from plain data, naming the bad field on any error."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names, key=str)     # keys may mix ints and strings
    if unknown:
        raise ConfigError(
            f"{join(where, unknown[0])}: unknown key; expected one of {sorted(names)}")
    kwargs = {k: _convert(hints[k], v, join(where, k)) for k, v in data.items()}
    return cls(**kwargs)



def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: expected one of {list(args)}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {k: _convert(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:                       # YAML 1.1 reads `1e-4` (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp is str and isinstance(value, int) and not isinstance(value, bool):
        return str(value)          # YAML reads `time: 90` or `name: 42` as a number
    if tp in (int, float, str, bool):
        if type(value) is not tp:
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp}")


def to_dict(obj: Any) -> Any:
    """Plain data (YAML/JSON-safe) of a config."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj



# ---------------------------------------------------------------------------------------
# Loading, overrides, saving
# ---------------------------------------------------------------------------------------
def apply_override(data: dict, override: str) -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected key.path=value")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {p} is not a section")
    # `key=` means the empty string (e.g. `model.checkpoint=` for random init), not YAML's null
    try:
        node[parts[-1]] = strict_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key.strip()}: the value {raw!r} is not valid YAML "
                          f"({_one_line(e)}); quote it in the shell") from None


def _one_line(e: Exception) -> str:
    """A YAML error's problem and position on one line (its str() spans several)."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def load_plan(path: str | os.PathLike | None, overrides: list[str] = ()) -> Plan:
    """Read, validate and resolve a config once (config/plan.py): what the CLIs hand down."""
    return resolve(_load_validated(path, overrides))


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Read a YAML file (or defaults if None), apply overrides, validate (the pools and
    groups too: it resolves the plan and keeps its config; callers that read pools, groups
    or the layout take `load_plan` instead)."""
    return load_plan(path, overrides).cfg


def _load_validated(path: str | os.PathLike | None, overrides: list[str]) -> Config:
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{p}: config file not found")
        try:
            data = strict_load(p.read_bytes().decode("utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: expected UTF-8 text, byte {e.object[e.start]:#04x} at offset "
                              f"{e.start} is not ({e.reason})") from None
        except OSError as e:
            raise ConfigError(f"{p}: cannot read the config file ({e.strerror})") from None
        except YAMLLimitError as e:
            raise ConfigError(f"{p}: refused: {_one_line(e)}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {_one_line(e)}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: expected a mapping at the top level")
    for o in overrides:
        apply_override(data, o)
    # a checkpoint's config.json gives its model's shapes before anything checks them;
    # `data` tells the fields the user set (refused if they disagree) from the defaults
    cfg = resolve_checkpoints(from_dict(Config, data), data)
    validate(cfg)
    return cfg



def save_config(cfg: Config, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))



# ---------------------------------------------------------------------------------------
# Help text from attribute docstrings
# ---------------------------------------------------------------------------------------
def field_docs(cls: type) -> dict[str, str]:
    """{field: docstring} from the string literal that follows each field in the source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def help_text(cls: type = Config, prefix: str = "") -> str:
    lines = []
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = join(prefix, f.name)
        if dataclasses.is_dataclass(tp):
            lines.append(help_text(tp, key))
            continue
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if dataclasses.is_dataclass(item):          # rollout.pools, trainer.named_groups
            lines.append(f"  {key} = []\n      {docs.get(f.name, '')}\n" + help_text(item, f"{key}[i]"))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        bound = bound_of(f)           # the same Bound validate's check_bounds reads
        rng = f"  [{'each ' if typing.get_origin(tp) is tuple else ''}{bound.text(tp is int)}]" if bound else ""
        lines.append(f"  {key} = {to_dict(default)!r}{rng}\n      {docs.get(f.name, '')}")
    return "\n".join(lines)
