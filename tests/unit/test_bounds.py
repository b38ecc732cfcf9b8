"""A numeric field's bounds live on the field (config/bounds.py): --help-config prints them
and validation refuses a value outside them naming the field, for every bounded field of
the schema (the tables below are read from the fields, not typed).

    pytest tests/unit/test_bounds.py
"""
from __future__ import annotations

import dataclasses
import typing

import pytest

from flexmarl_hpc.config import schema, tools
from flexmarl_hpc.config.bounds import Bound, bound_of
from flexmarl_hpc.config.load import help_text, load_config
from flexmarl_hpc.config.schema import Config, ConfigError, join
from flexmarl_hpc.config.validate import validate
from tests.conftest import ROOT
from tests.helpers import replaced_at

# hetero_cpu.yaml has an instance of every section that holds bounded fields: turns, per-agent
# models, rollout pools (with their slurm components)
BASE = load_config(ROOT / "configs/hetero_cpu.yaml")


def bounded_fields(obj, where: str = ""):
    """(path, owner, field, bound) of every bounded field of a config instance, nested
    sections, list items (`[i]`) and mapping values (`.key`) included."""
    for f in dataclasses.fields(obj):
        value, path = getattr(obj, f.name), join(where, f.name)
        if bound_of(f) is not None:
            yield path, obj, f, bound_of(f)
        elif dataclasses.is_dataclass(value):
            yield from bounded_fields(value, path)
        elif isinstance(value, (list, dict)):
            for k, item in (value.items() if isinstance(value, dict) else enumerate(value)):
                if dataclasses.is_dataclass(item):
                    yield from bounded_fields(item, f"{path}.{k}" if isinstance(value, dict) else f"{path}[{k}]")


def schema_bounds() -> set[tuple[str, str]]:
    """(class, field) of every bounded field declared in the config's sections
    (config/schema.py, config/tools.py)."""
    return {(cls.__name__, f.name) for mod in (schema, tools) for cls in vars(mod).values()
            if dataclasses.is_dataclass(cls) and cls.__module__ == mod.__name__
            for f in dataclasses.fields(cls) if bound_of(f) is not None}


def test_no_section_checks_a_plain_range_by_hand():
    """Every numeric field of the sections that pydantic would give `ge=` has its bound on
    the field (so --help-config shows it): the ints and floats of the config with none are
    the ones listed here, each with why it has no range."""
    unbounded = {(cls.__name__, f.name) for mod in (schema, tools) for cls in vars(mod).values()
                 if dataclasses.is_dataclass(cls) and cls.__module__ == mod.__name__
                 for f in dataclasses.fields(cls)
                 if typing.get_type_hints(cls)[f.name] in (int, float) and bound_of(f) is None}
    assert unbounded == set(), unbounded


FIELDS = {path: (bound, f) for path, _, f, bound in bounded_fields(BASE)}


def outside(bound: Bound, integer: bool) -> list[float]:
    """Values just outside `bound`: below it, and above it where it has a top."""
    low = bound.lo if bound.lo_open else bound.lo - 1
    out = [int(low) if integer else float(low)]
    if bound.hi is not None:
        high = bound.hi if bound.hi_open else bound.hi + 1
        out.append(int(high) if integer else float(high))
    return out


def test_the_table_covers_every_bounded_field_of_the_schema():
    seen = {(type(owner).__name__, f.name) for _, owner, f, _ in bounded_fields(BASE)}
    assert seen == schema_bounds() and len(seen) >= 60


@pytest.mark.parametrize("path", sorted(FIELDS))
def test_a_value_out_of_bounds_is_refused_naming_the_field(path):
    bound, f = FIELDS[path]
    integer = typing.get_type_hints(type(_owner(BASE, path)))[f.name] is int
    for bad in outside(bound, integer):
        old, where = getattr(_owner(BASE, path), f.name), path
        if isinstance(old, tuple):                   # trainer.betas: each element
            bad, where = (bad, *old[1:]), f"{path}[0]"
        cfg = replaced_at(BASE, path, bad)
        with pytest.raises(ConfigError) as e:
            validate(cfg)
        shown = bad[0] if isinstance(bad, tuple) else bad
        assert str(e.value) == f"{where}: expected {bound.text(integer)}, got {shown if integer else repr(shown)}"


def test_in_bounds_values_pass_and_the_messages_keep_their_form():
    validate(BASE)
    with pytest.raises(ConfigError, match=r"^run.checkpoint_every: expected >= 0 \(0: by minutes only\), got -1$"):
        validate(replaced_at(BASE, "run.checkpoint_every", -1))
    with pytest.raises(ConfigError, match=r"^rollout.top_p: expected 0 < x <= 1, got 0.0$"):
        validate(replaced_at(BASE, "rollout.top_p", 0.0))


def test_help_shows_each_fields_bound():
    text = help_text(Config)
    for cls_path, cls in _help_sections(Config):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            bound = bound_of(f)
            if bound is None:
                continue
            key = join(cls_path, f.name)
            line = next((ln for ln in text.splitlines() if ln.startswith(f"  {key} = ")), None)
            assert line is not None, key
            each = "each " if typing.get_origin(hints[f.name]) is tuple else ""
            assert line.endswith(f"  [{each}{bound.text(hints[f.name] is int)}]"), line


def _help_sections(cls, prefix: str = ""):
    """(help prefix, class) of every section help_text prints (list items as `[i]`)."""
    yield prefix, cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if dataclasses.is_dataclass(tp):
            yield from _help_sections(tp, join(prefix, f.name))
        elif dataclasses.is_dataclass(item):
            yield from _help_sections(item, f"{join(prefix, f.name)}[i]")


def _owner(cfg, path: str):
    """The dataclass holding the last field of `path` (`rollout.pools[0].slurm.nodes`)."""
    obj = cfg
    for part in path.split(".")[:-1]:
        name, _, idx = part.partition("[")
        obj = obj[name] if isinstance(obj, dict) else getattr(obj, name)
        if idx:
            obj = obj[int(idx.rstrip("]"))]
    return obj
