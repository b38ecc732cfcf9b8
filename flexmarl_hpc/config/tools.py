"""The tools' config: the `tools:` section of a run's config (config/schema.py); field
docstrings are the help text, as there. The user functions it names are read here, at load,
from their files with `ast` (their schemas; tools/functions.py runs them in the sandbox).

Kept free of torch and mpi4py, like config/.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from flexmarl_hpc.config.bounds import bounded
from flexmarl_hpc.config.errors import ConfigError

NOBODY = 65534
MAX_RANKS = 256
BUILTIN_TOOLS = ("calculator", "python")
"""The bundled tools (tools/functions.py holds their schemas); a user tool may not take their names."""


@dataclass(frozen=True)
class ToolsConfig:
    cpu_s: int = bounded(5, ge=1)
    """CPU seconds of the sandboxed code (RLIMIT_CPU; SIGXCPU, then SIGKILL a second later)."""
    wall_s: float = bounded(10.0, gt=0)
    """Wall-clock seconds of one sandboxed call; then its whole process group is killed."""
    memory_mb: int = bounded(512, ge=1)
    """Address space of the sandboxed code in MiB (RLIMIT_AS); a bigger allocation fails."""
    file_mb: int = bounded(16, ge=1)
    """Largest file the sandboxed code may write, in MiB (RLIMIT_FSIZE); as root also all it
    writes in total (the minimal root's one writable tmpfs, tools/launcher.py)."""
    nproc: int = bounded(32, ge=1)
    """Processes of the sandbox uid (RLIMIT_NPROC); counted over every sandbox of that uid
    running on the machine at once, so it must cover `workers` calls."""
    output_bytes: int = bounded(8192, ge=1)
    """stdout and stderr of a call are each cut to this many bytes."""
    workers: int = bounded(4, ge=1)
    """Tool calls and reward functions running at once; more wait for a free slot."""
    uid: int = bounded(NOBODY, ge=1)
    """The uid (and gid) the code runs as when the caller is root (65534: nobody/nogroup)."""
    python: str = ""
    """Interpreter of the sandboxed code, run with -I -S (stdlib only). Empty: this one
    (sys.executable) if the sandbox uid can reach it, else /usr/bin/python3."""
    calc_max_digits: int = bounded(1000, ge=1)
    """The calculator refuses results (and powers) with more digits than this."""
    ranks: int = bounded(0, ge=0, le=MAX_RANKS, note=" (0: a local process pool)")
    """Tool ranks: a het component of their own (slurm.tools; under mpiexec, the last ranks),
    each running `workers` calls at once; the orchestrator sends them its episodes' tool
    calls and `ctx.call` functions over MPI. 0: a process pool on the orchestrator's node."""
    functions: dict[str, str] = field(default_factory=dict)
    """User tools: {name: 'module:function'}, a module-level def in a stdlib-only file, run
    in the sandbox like model-written code (tools/functions.py; never imported by the run)."""

    def __post_init__(self) -> None:
        # the numbers' ranges are their bounds (config/bounds.py), checked by validate with
        # the rest of the config; what is left reads files
        self._check_functions()
        if self.python and not os.access(self.python, os.X_OK):
            raise ConfigError(f"tools.python: expected an executable interpreter, got {self.python!r}")

    def _check_functions(self) -> None:
        if not isinstance(self.functions, dict):
            raise ConfigError(f"tools.functions: expected {{name: 'module:function'}}, got {self.functions!r}")
        for name, spec in self.functions.items():
            if not isinstance(name, str) or not name.isidentifier() or name in BUILTIN_TOOLS:
                raise ConfigError(f"tools.functions: {name!r} is no identifier or shadows a built-in tool")
            try:
                read_function(name, spec if isinstance(spec, str) else repr(spec))
            except ValueError as e:
                raise ConfigError(str(e)) from None

    def interpreter(self) -> str:
        if self.python:
            return self.python
        here = os.path.realpath(sys.executable)
        return here if others_can_run(here) else "/usr/bin/python3"


def others_can_run(path: str) -> bool:
    """Whether a uid with no special rights can execute `path`: o+x on the file and on every
    directory above it (a venv's python often points into /root, which is 0700)."""
    p = Path(path)
    return all(q.stat().st_mode & stat.S_IXOTH for q in [p, *p.parents])


JSON_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "array",
              "dict": "object"}


@dataclass(frozen=True)
class FunctionSpec:
    """A user tool as read from its file (nothing of it run here)."""
    name: str
    """The tool's name, as the model calls it (the key of tools.functions)."""
    file: str
    function: str
    source: str
    schema: dict


def read_function(name: str, spec: str) -> FunctionSpec:
    """`module:function` read from its file; ValueError saying what is wrong (config load)."""
    where = f"tools.functions.{name}"
    mod, _, fn = spec.partition(":")
    if not mod or not fn.isidentifier():
        raise ValueError(f"{where}: expected 'module:function', got {spec!r}")
    try:
        found = importlib.util.find_spec(mod)
    except (ImportError, ValueError) as e:
        raise ValueError(f"{where}: cannot find module {mod!r}: {e}") from None
    if found is None or not found.origin or not found.origin.endswith(".py"):
        raise ValueError(f"{where}: no Python file for module {mod!r}")
    source = Path(found.origin).read_text(encoding="utf-8")
    try:
        tree = ast.parse(source, found.origin)
    except SyntaxError as e:
        raise ValueError(f"{where}: {found.origin}:{e.lineno}: {e.msg}") from None
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == fn]
    if not defs:
        raise ValueError(f"{where}: {found.origin} has no module-level `def {fn}`")
    return FunctionSpec(name, found.origin, fn, source, _schema(name, defs[-1]))


def _schema(name: str, node: ast.FunctionDef) -> dict:
    """The OpenAI function schema of a def: its docstring's first paragraph, its arguments
    with their annotated types (plain names only; others are left untyped)."""
    args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
    n_defaults = len(node.args.defaults)
    plain = node.args.posonlyargs + node.args.args
    required = [a.arg for a in plain[:len(plain) - n_defaults]]
    required += [a.arg for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is None]
    props = {}
    for a in args:
        t = JSON_TYPES.get(a.annotation.id) if isinstance(a.annotation, ast.Name) else None
        props[a.arg] = {"type": t} if t else {}
    doc = (ast.get_docstring(node) or "").split("\n\n")[0].strip()
    return {"type": "function", "function": {"name": name, "description": doc, "parameters": {
        "type": "object", "properties": props, "required": required}}}
