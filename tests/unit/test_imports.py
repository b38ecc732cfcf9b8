"""The login-node side stays light: the config, the Slurm scripts and `submit` import no torch
and no mpi4py, so `submit --dry-run` and `simulate` start in a second on a login node.

    pytest tests/test_imports.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT
LOCAL = str(ROOT / "configs" / "local.yaml")
LIGHT = ["flexmarl_hpc.config.schema", "flexmarl_hpc.config.load", "flexmarl_hpc.config.validate",
         "flexmarl_hpc.config.validate_slurm", "flexmarl_hpc.config.resources",
         "flexmarl_hpc.config.layout", "flexmarl_hpc.launch.sbatch", "flexmarl_hpc.launch.preflight",
         "flexmarl_hpc.submit"]
HEAVY = ("torch", "mpi4py")


def heavy_modules_after(code: str) -> list[str]:
    """The HEAVY modules in sys.modules after `code` ran in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    p = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_config_and_submit_import_no_torch_or_mpi():
    assert heavy_modules_after("\n".join(f"import {m}" for m in LIGHT)) == []


def test_submit_dry_run_imports_no_torch_or_mpi():
    code = ("import contextlib, io\nfrom flexmarl_hpc.submit import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            f"    assert main([{LOCAL!r}, '--dry-run', '--no-partition-check']) == 0\n"
            f"    assert main([{LOCAL!r}, '--dry-run', '--no-partition-check', '--single']) == 0")
    assert heavy_modules_after(code) == []


def test_the_probe_sees_torch():
    """The check can fail: a module that imports torch is reported."""
    assert heavy_modules_after("import torch") == ["torch"]
