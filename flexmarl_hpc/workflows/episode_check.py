"""workflow.episode and workflow.episode_args checked before launch, the module imported in a
child process (user code that hangs, exits or changes the interpreter stays out of the launcher).

    check_episode(cfg.workflow.episode, cfg.workflow.episode_args)   # raises ConfigError (one line)
    python -m flexmarl_hpc.workflows.episode_check MODULE:FUNCTION < ARGS.json   # the child

An episode declares the episode_args it reads as a dataclass named `ARGS` in its module
(docs/episodes.md): a key that is no field of it, or a value that is not of its field's type,
is refused by name, and its `__post_init__` may refuse a value (ValueError). Without `ARGS`
the args are given to the episode unchecked.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import subprocess
import sys
import traceback
import types
import typing

from flexmarl_hpc.config.schema import ConfigError

IMPORT_TIMEOUT_S = 120.0
"""How long the child may take to import the episode's module (a torch import is ~10 s)."""


def check_episode(spec: str, args: dict, timeout: float = IMPORT_TIMEOUT_S, field: str = "workflow.episode") -> None:
    """Import `spec` in a child process with this interpreter's sys.path and check `args`
    against its declaration (or, for a `field` of PROGRAMS, its arguments); raises
    ConfigError with the child's one line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
    which = [spec] if field == "workflow.episode" else ["--field", field, spec]
    try:
        p = subprocess.run([sys.executable, "-m", "flexmarl_hpc.workflows.episode_check", *which],
                           input=json.dumps(args, default=str), capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{field}: importing {spec!r} did not finish in {timeout:.0f} s") from None
    if p.returncode != 0:
        lines = p.stderr.strip().splitlines() or [f"the check exited {p.returncode}"]
        line = lines[-1] if lines[-1].startswith(field) else \
            f"{field}: importing {spec!r} ended the process ({lines[-1][:300]})"
        raise ConfigError(line.removeprefix("config error: ")) from None


def _where(e: BaseException) -> str:
    """file:line of an import error: a SyntaxError's own, else the innermost frame of user code."""
    if isinstance(e, SyntaxError):
        return f"{e.filename}:{e.lineno}"
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<frozen")]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


PROGRAMS = {"workflow.agent": 2, "workflow.reward": 3}
"""Fields naming a plain function (sync or async) and the positional arguments it is given:
the `openai` program (base_url, example), the reward (example, result, transcript)."""


def load(spec: str, field: str = "workflow.episode"):
    """(module, function) of `module:function`; ConfigError (one line naming file:line) on
    any error its import raises."""
    mod_name, _, fn_name = spec.partition(":")
    try:
        module = importlib.import_module(mod_name)
    except SyntaxError as e:
        raise ConfigError(f"{field}: {spec!r}: syntax error at {_where(e)}: {e.msg}") from None
    except BaseException as e:             # noqa: BLE001 (SystemExit too: user code at import time)
        msg = " ".join(str(e).split())[:200]
        raise ConfigError(f"{field}: importing {mod_name!r} raised {type(e).__name__}: {msg} "
                          f"(at {_where(e)})") from None
    fn = getattr(module, fn_name, None)
    if field in PROGRAMS:
        _check_program(spec, fn, field)
    elif not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"{field}: {spec!r} is not an `async def episode(ctx, example)`")
    return module, fn


def _check_program(spec: str, fn, field: str) -> None:
    """A function (sync or async) that takes PROGRAMS[field] positional arguments."""
    n = PROGRAMS[field]
    try:
        inspect.signature(fn).bind(*range(n))
    except (TypeError, ValueError):
        what = "(base_url, example)" if n == 2 else "(example, result, transcript)"
        raise ConfigError(f"{field}: {spec!r} is not a function taking {what}") from None


def check_args(declared, args: dict) -> None:
    """`args` against the dataclass `declared`: known keys, values of each field's type, and
    whatever its __post_init__ refuses; ConfigError naming the key."""
    fields = {f.name: f for f in dataclasses.fields(declared)}
    unknown = sorted(set(args) - set(fields))
    if unknown:
        raise ConfigError(f"workflow.episode_args: unknown {unknown}, expected some of {sorted(fields)} "
                          f"({declared.__module__}.{declared.__qualname__})")
    hints = typing.get_type_hints(declared)
    for key, value in args.items():
        if not _is(value, hints.get(key, typing.Any)):
            raise ConfigError(f"workflow.episode_args.{key}: expected {_name(hints[key])}, got {value!r}")
    try:
        declared(**args)
    except (ValueError, TypeError) as e:
        raise ConfigError(" ".join(str(e).split())[:300]
                          if str(e).startswith("workflow.episode_args") else
                          f"workflow.episode_args: {' '.join(str(e).split())[:300]}") from None


def _is(value, hint) -> bool:
    """Whether a YAML value fits a type hint (float takes an int; bool is no number)."""
    if hint is typing.Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is(value, h) for h in typing.get_args(hint))
    if origin is not None:
        return isinstance(value, origin)
    if hint is type(None):
        return value is None
    if isinstance(value, bool) and hint is not bool:
        return False
    if hint is float:
        return isinstance(value, (int, float))
    return isinstance(value, hint) if isinstance(hint, type) else True


def _name(hint) -> str:
    return getattr(hint, "__name__", str(hint))


def main(argv: list[str]) -> int:
    try:
        if len(argv) == 3 and argv[0] == "--field":          # workflow.agent / workflow.reward
            load(argv[2], argv[1])
            return 0
        module, _ = load(argv[0])
        declared = getattr(module, "ARGS", None)
        if dataclasses.is_dataclass(declared) and isinstance(declared, type):
            check_args(declared, json.loads(sys.stdin.read() or "{}"))
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
