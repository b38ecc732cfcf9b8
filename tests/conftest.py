"""Shared test fixtures.

Under CI (CI=true) a test that needs MPI, Slurm or HDF5 FAILS when they are missing,
never skips; only GPU tests skip, with a visible reason.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need(condition: bool, what: str) -> None:
    """Skip (outside CI) or fail (in CI) when a required real component is missing."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"{what} is required under CI=true but missing")
    pytest.skip(f"{what} missing")


def mpiexec_path() -> str | None:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


@pytest.fixture(scope="session")
def mpiexec() -> str:
    path = mpiexec_path()
    need(path is not None, "mpiexec (pip mpich)")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        need(False, "mpi4py")
    return path


def run_mpi(mpiexec: str, n: int, args: list[str], timeout: float = 300, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run `python -m mpi4py ARGS` on n real MPI ranks from the repo root (an uncaught
    exception on any rank aborts the whole job instead of hanging it)."""
    cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "mpi4py", *args]
    e = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    p = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\nstdout:\n{p.stdout[-4000:]}\n"
                             f"stderr:\n{p.stderr[-4000:]}")
    return p


def run_training(tmp: Path, *overrides: str, config: str = "configs/local.yaml", timeout: float = 300,
                 check: bool = True, python: str = sys.executable) -> subprocess.CompletedProcess:
    """`python -m flexmarl_hpc.run` (it launches its own mpiexec) into tmp."""
    cmd = [python, "-m", "flexmarl_hpc.run", config, f"run.output_dir={tmp}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\nstdout:\n{p.stdout[-4000:]}\n"
                             f"stderr:\n{p.stderr[-4000:]}")
    return p


def pytest_report_header(config):
    return f"CI={IN_CI}: missing MPI/Slurm/HDF5 {'fails' if IN_CI else 'skips'}; GPU tests skip without a GPU"
