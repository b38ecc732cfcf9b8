"""Per-agent checkpoints: one file of named tensors per version, `latest` points at it.

Files hold only tensors (model, optimizer state, RNG, version), saved with `torch.save`
and loaded with `torch.load(weights_only=True)`, so loading runs no pickled code. A
checkpoint becomes visible only after it is complete (write to .tmp, fsync, rename).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from . import faults


def save_checkpoint(folder: Path, version: int, state: dict[str, torch.Tensor], keep: int = 2) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"v{version:06d}.pt"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        faults.hit("checkpoint_write")         # test-only: no-op unless FLEXMARL_FAULT is set
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    faults.hit("checkpoint_latest")
    latest = folder / "latest"
    latest.with_suffix(".tmp").write_text(path.name)
    os.replace(latest.with_suffix(".tmp"), latest)
    for old in sorted(folder.glob("v*.pt"))[:-keep]:
        old.unlink()
    return path


def latest_version(folder: Path) -> int | None:
    latest = folder / "latest"
    if not latest.is_file():
        return None
    return int(latest.read_text().strip()[1:7])


def load_latest(folder: Path) -> dict[str, torch.Tensor] | None:
    latest = folder / "latest"
    if not latest.is_file():
        return None
    path = folder / latest.read_text().strip()
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:
        raise RuntimeError(f"{path}: cannot load checkpoint: {e}") from e
