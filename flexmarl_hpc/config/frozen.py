"""Read-only copies of config trees: what config/plan.resolve hands out.

    plan = freeze(Plan(...))          # every dataclass, list and mapping in it read-only

The config's dataclasses are frozen (config/schema.py), but the lists and mappings in them
(workflow.turns, agents, slurm.sbatch_options, ...) are not: `freeze` copies a tree with
them replaced by FrozenList / FrozenDict, subclasses of list and dict (so isinstance checks,
equality with plain lists and JSON keep working) whose every mutator raises TypeError.
Pure: the standard library only.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any


def _refuse(self, *args: Any, **kwargs: Any) -> None:
    raise TypeError(f"{type(self).__name__}: the resolved plan is read-only; "
                    "build a changed copy (dataclasses.replace) before resolving")


class FrozenList(list):
    """A list whose contents cannot change."""
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse
    append = extend = insert = pop = remove = clear = sort = reverse = _refuse

    def __reduce__(self):                 # pickle/deepcopy rebuild it whole, not by append
        return type(self), (list(self),)


class FrozenDict(dict):
    """A dict whose contents cannot change."""
    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self):
        return type(self), (dict(self),)


def freeze(value: Any) -> Any:
    """A copy of `value` whose lists and dicts, at any depth inside frozen dataclasses,
    tuples, lists and dicts, are FrozenList / FrozenDict (other leaves are shared)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = copy.copy(value)            # no __init__: __post_init__ checks ran at load
        for f in dataclasses.fields(value):
            object.__setattr__(out, f.name, freeze(getattr(value, f.name)))
        return out
    if isinstance(value, tuple):
        items = [freeze(v) for v in value]
        return type(value)._make(items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return FrozenList(freeze(v) for v in value)
    if isinstance(value, dict):
        return FrozenDict({k: freeze(v) for k, v in value.items()})
    return value
