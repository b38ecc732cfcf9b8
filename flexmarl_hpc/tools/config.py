"""The tools' config: the `tools:` section of a run's config (config/schema.py); field
docstrings are the help text, as there.

Kept free of torch and mpi4py, like config/.
"""
from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

NOBODY = 65534
MAX_RANKS = 256


@dataclass(frozen=True)
class ToolsConfig:
    cpu_s: int = 5
    """CPU seconds of the sandboxed code (RLIMIT_CPU; SIGXCPU, then SIGKILL a second later)."""
    wall_s: float = 10.0
    """Wall-clock seconds of one sandboxed call; then its whole process group is killed."""
    memory_mb: int = 512
    """Address space of the sandboxed code in MiB (RLIMIT_AS); a bigger allocation fails."""
    file_mb: int = 16
    """Largest file the sandboxed code may write, in MiB (RLIMIT_FSIZE); as root also all it
    writes in total (the minimal root's one writable tmpfs, tools/launcher.py)."""
    nproc: int = 32
    """Processes of the sandbox uid (RLIMIT_NPROC); counted over every sandbox of that uid
    running on the machine at once, so it must cover `workers` calls."""
    output_bytes: int = 8192
    """stdout and stderr of a call are each cut to this many bytes."""
    workers: int = 4
    """Tool calls and reward functions running at once; more wait for a free slot."""
    uid: int = NOBODY
    """The uid (and gid) the code runs as when the caller is root (65534: nobody/nogroup)."""
    python: str = ""
    """Interpreter of the sandboxed code, run with -I -S (stdlib only). Empty: this one
    (sys.executable) if the sandbox uid can reach it, else /usr/bin/python3."""
    calc_max_digits: int = 1000
    """The calculator refuses results (and powers) with more digits than this."""
    ranks: int = 0
    """Tool ranks: a het component of their own (slurm.tools; under mpiexec, the last ranks),
    each running `workers` calls at once; the orchestrator sends them its episodes' tool
    calls and `ctx.call` functions over MPI. 0: a process pool on the orchestrator's node."""
    functions: dict[str, str] = field(default_factory=dict)
    """User tools: {name: 'module:function'}, a module-level def in a stdlib-only file, run
    in the sandbox like model-written code (tools/functions.py; never imported by the run)."""

    def __post_init__(self) -> None:
        from flexmarl_hpc.config.schema import ConfigError     # a section of it (no cycle at import)
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "ranks":
                if not (isinstance(v, int) and 0 <= v <= MAX_RANKS):
                    raise ConfigError(f"tools.ranks: expected 0..{MAX_RANKS} (0: a local process pool), got {v!r}")
            elif f.name == "functions":
                self._check_functions()
            elif f.name != "python" and not (isinstance(v, (int, float)) and v > 0):
                raise ConfigError(f"tools.{f.name}: expected a positive number, got {v!r}")
        if self.python and not os.access(self.python, os.X_OK):
            raise ConfigError(f"tools.python: expected an executable interpreter, got {self.python!r}")

    def _check_functions(self) -> None:
        from flexmarl_hpc.config.schema import ConfigError
        from flexmarl_hpc.tools.functions import BUILTIN_SCHEMAS, read_function
        if not isinstance(self.functions, dict):
            raise ConfigError(f"tools.functions: expected {{name: 'module:function'}}, got {self.functions!r}")
        for name, spec in self.functions.items():
            if not isinstance(name, str) or not name.isidentifier() or name in BUILTIN_SCHEMAS:
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
