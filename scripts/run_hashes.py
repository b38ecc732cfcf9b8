"""Hashes of what a run trained, for comparing two runs of the same seeded config (a
refactor must not change them): sha256 (first 16 hex) of the store's /samples and /steps
rows without their wall-clock columns (`t_*`), and of every checkpoint tensor but `rng`
(the trainer process's global torch RNG state, which differs between two runs of the same
code).

    python -m flexmarl_hpc.run configs/local.yaml run.steps=4 run.output_dir=/tmp/a
    .venv/bin/python scripts/run_hashes.py /tmp/a         # samples ... steps ... checkpoints ...
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import h5py
import torch


def rows_hash(h5: Path, group: str) -> str:
    h = hashlib.sha256()
    with h5py.File(h5, "r") as f:
        for agent in sorted(f[group]):
            rows = f[group][agent][()]
            for name in rows.dtype.names:
                if not name.startswith("t_"):
                    h.update(f"{agent}/{name}".encode())
                    h.update(rows[name].tobytes())
    return h.hexdigest()[:16]


def checkpoints_hash(out: Path) -> str:
    h = hashlib.sha256()
    for path in sorted((out / "checkpoints").rglob("*.pt")):
        state = torch.load(path, weights_only=True, map_location="cpu")
        for key in sorted(state):
            if key != "rng" and isinstance(state[key], torch.Tensor):
                h.update(f"{path.parent.name}/{path.name}/{key}".encode())
                h.update(state[key].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: run_hashes.py RUN_OUTPUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    h5 = next(out.glob("*.h5"), None)
    if h5 is None:
        print(f"{out}: no store (*.h5) in the run folder", file=sys.stderr)
        return 2
    print(f"samples {rows_hash(h5, 'samples')} steps {rows_hash(h5, 'steps')} "
          f"checkpoints {checkpoints_hash(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
