"""Write environment.yml (the conda environment of GPU sites) from requirements-gpu.lock:

    python scripts/env_from_lock.py > environment.yml     # LOCK_GPU=1 bash scripts/lock.sh runs it

Every locked package at its locked version, the Python of the lock's header, nothing typed by
hand: tests/unit/test_env.py renders it again in memory and fails when the file differs.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

LOCK = "requirements-gpu.lock"
HEADER = """\
# GENERATED from {lock} by scripts/env_from_lock.py (LOCK_GPU=1 bash scripts/lock.sh);
# do not edit: tests/unit/test_env.py fails when this file and the lock disagree.
# The conda environment of a GPU site (Linux x86_64, CUDA 13 driver):
#   conda env create -f environment.yml && conda activate flexmarl
# conda's pip section cannot check hashes: scripts/setup_gpu.sh installs the same lock with
# pip --require-hashes into a venv. Transformer Engine is not in the lock (docs/environment.md).
# Use the site's MPI where possible: drop mpich and build mpi4py against the module's MPI
# (pip install --no-binary mpi4py mpi4py==<locked>) so srun --mpi=pmix works.
"""


def pins(lock_text: str) -> list[tuple[str, str]]:
    """(name, version) of each locked entry, in the lock's order."""
    found = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+) \\$", lock_text, re.M)
    if not found:
        raise ValueError(f"{LOCK}: no `name==version \\` entries (not a hashed lock)")
    return found


def python_version(lock_text: str) -> str:
    m = re.search(r"--python-version (\d+\.\d+)", lock_text)
    if not m:
        raise ValueError(f"{LOCK}: its header names no --python-version")
    return m.group(1)


def render(lock_text: str) -> str:
    lines = [HEADER.format(lock=LOCK), "name: flexmarl", "channels: [conda-forge]", "dependencies:",
             f"  - python={python_version(lock_text)}", "  - pip", "  - pip:"]
    lines += [f"      - {name}=={version}" for name, version in pins(lock_text)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1]
    sys.stdout.write(render((root / LOCK).read_text()))
