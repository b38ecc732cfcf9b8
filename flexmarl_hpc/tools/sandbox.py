"""Run model-written Python in a separate, limited, isolated process; never raise.

    result = await run_code("print(6 * 7)", ToolsConfig())     # or run_code_sync(...)
    result.outcome, result.stdout, result.isolation             # 'ok', '42\\n', {...}

Each call gets a fresh directory (removed afterwards) with the code as main.py, a minimal
environment, and `launcher.py` between us and the code (namespaces, private /tmp, rlimits,
the sandbox uid). The wall-clock limit is ours: past it the launcher's process group is
killed, and with it the code's pid namespace. docs/tools.md lists the guarantees.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from flexmarl_hpc.config.tools import ToolsConfig

LAUNCHER = Path(__file__).with_name("launcher.py")
LAUNCH_FAILED = 125                      # launcher.LAUNCH_FAILED (not imported: it is a script)
OUTCOMES = ("ok", "error", "timeout", "killed_cpu", "memory", "file_size", "crashed", "launch_failed")
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp"}
TAIL = 512                               # bytes of stderr kept apart to classify the ending


@dataclass(frozen=True)
class SandboxResult:
    outcome: str
    """One of OUTCOMES."""
    stdout: str
    stderr: str
    exit_code: int | None = None
    """The code's exit status when it exited, else None."""
    signal: int | None = None
    """The signal that ended the code, else None."""
    wall_s: float = 0.0
    cpu_s: float | None = None
    isolation: dict = field(default_factory=dict)
    """What was in force: network ('netns', 'userns+netns' or 'host'), mount, pid,
    private_tmp, private_proc (bools) and uid."""
    truncated: bool = False


class _Capped:
    """Reads a stream to its end, keeping the first `cap` bytes and the last TAIL."""

    def __init__(self, cap: int):
        self.cap, self.head, self.tail, self.total = cap, bytearray(), b"", 0

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            self.total += len(chunk)
            if len(self.head) < self.cap:
                self.head += chunk[: self.cap - len(self.head)]
            self.tail = (self.tail + chunk)[-TAIL:]

    def text(self) -> str:
        return self.head.decode("utf-8", "replace")


def classify(status: int | None, cpu_s: float | None, err_tail: str, cfg: ToolsConfig) -> str:
    """The outcome of a call that ended by itself, from the code's wait status (None: the
    launcher did not report one)."""
    if status is None:
        return "launch_failed"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and (cpu_s or 0) >= cfg.cpu_s):
            return "killed_cpu"
        return "file_size" if sig == signal.SIGXFSZ else "crashed"
    code = os.WEXITSTATUS(status)
    last = err_tail.strip().splitlines()[-1] if err_tail.strip() else ""
    if code == 0:
        return "ok"
    if code == LAUNCH_FAILED and last.startswith("sandbox launcher:"):
        return "launch_failed"
    if last.startswith("MemoryError"):
        return "memory"
    return "file_size" if "File too large" in last else "error"


def _prepare(code: str, cfg: ToolsConfig) -> tuple[Path, dict]:
    """A fresh base directory (root's) holding work/ (the sandbox uid's, with main.py) and
    the launcher's report; returns it and the launcher's spec."""
    base = Path(tempfile.mkdtemp(prefix="flexmarl-sandbox-"))
    work = base / "work"
    work.mkdir(mode=0o700)
    (work / "main.py").write_text(code, encoding="utf-8")
    if os.geteuid() == 0:
        for p in (work, work / "main.py"):
            os.chown(p, cfg.uid, cfg.uid)
    spec = {"python": cfg.interpreter(), "script": "main.py", "workdir": str(work),
            "report": str(base / "report.json"), "env": ENV, "uid": cfg.uid, "gid": cfg.uid,
            "parent": os.getpid(), "limits": {"cpu_s": cfg.cpu_s, "memory_bytes": cfg.memory_mb << 20,
                       "file_bytes": cfg.file_mb << 20, "nproc": cfg.nproc}}
    return base, spec


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def _launch(spec: dict, cfg: ToolsConfig, out: _Capped, err: _Capped) -> bool:
    """Run the launcher to its end or to the wall-clock limit; True when it timed out."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", str(LAUNCHER), json.dumps(spec), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=ENV, start_new_session=True)
    readers = asyncio.gather(out.drain(proc.stdout), err.drain(proc.stderr))
    timed_out = False
    try:
        await asyncio.wait_for(proc.wait(), cfg.wall_s)
    except asyncio.TimeoutError:
        timed_out = True
    finally:                        # also on cancellation: the process group never outlives us
        _kill_group(proc.pid)
        try:                        # asyncio's wait() also waits for the pipes to close, which
            await asyncio.wait_for(proc.wait(), 2.0)     # an escaped process (below) can delay
        except asyncio.TimeoutError:
            pass
    try:                            # without a pid namespace an escaped child may hold the pipes
        await asyncio.wait_for(readers, 1.0)
    except asyncio.TimeoutError:
        pass
    return timed_out


async def run_code(code: str, cfg: ToolsConfig) -> SandboxResult:
    """Run `code` in the sandbox; a defined result whatever the code does."""
    t0 = time.perf_counter()
    out, err = _Capped(cfg.output_bytes), _Capped(cfg.output_bytes)
    base = None
    try:
        base, spec = _prepare(code, cfg)
        timed_out = await _launch(spec, cfg, out, err)
        lines = (base / "report.json").read_text().splitlines()
    except (OSError, ValueError) as e:
        return SandboxResult("launch_failed", "", f"{type(e).__name__}: {e}", wall_s=time.perf_counter() - t0)
    finally:
        if base is not None:
            shutil.rmtree(base, ignore_errors=True)
    isolation = json.loads(lines[0]) if lines else {}
    end = json.loads(lines[1]) if len(lines) > 1 else {}
    status, cpu_s = end.get("status"), end.get("cpu_s")
    # the code ended by itself if the launcher reported its status, even when something it
    # started held the pipes open past the limit (possible only without a pid namespace)
    err_tail = err.tail.decode("utf-8", "replace")
    outcome = "timeout" if timed_out and status is None else classify(status, cpu_s, err_tail, cfg)
    return SandboxResult(
        outcome, out.text(), err.text(),
        exit_code=os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else None,
        signal=os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None,
        wall_s=time.perf_counter() - t0, cpu_s=cpu_s, isolation=isolation,
        truncated=max(out.total, err.total) > cfg.output_bytes)


def run_code_sync(code: str, cfg: ToolsConfig) -> SandboxResult:
    """run_code for callers without an event loop."""
    return asyncio.run(run_code(code, cfg))
