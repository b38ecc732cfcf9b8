"""The store's re-open on a resume (checks, then repairs): seconds for a closed store of
2 agents x N samples (the second agent's rows children of the first's) and 2N events.

    python bench/bench_reopen.py [--samples 200000] [--reps 5]

Each rep also gives the peak of memory the re-open's checks allocate (tracemalloc: numpy's
arrays and h5py's reads are traced; the file's own HDF5 cache is not).

Each rep re-opens a fresh copy of the same file (StoreFile, then the file closed without a
flush), so every rep makes the same checks. To compare two checkouts, run this file with
PYTHONPATH set to each, interleaved (docs/LOG.md, 2026-11-29, issue 38).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from flexmarl_hpc.store.schema import GENERATED
from flexmarl_hpc.store.tables import StoreFile

AGENTS = ["a", "b"]


def make(path: Path, n: int) -> None:
    s = StoreFile(path, AGENTS, {})
    for k in range(0, n, 1000):
        for i, a in enumerate(AGENTS):
            rows = np.zeros(1000, s.samples[a].dtype)
            rows["sample_id"] = [f"{k + j}_{i}_0".encode() for j in range(1000)]
            rows["parent_id"] = [f"{k + j}_0_0".encode() if i else b"" for j in range(1000)]
            rows["status"], rows["trainer_step"] = GENERATED, -1
            rows["reward"] = rows["advantage"] = rows["t_ready"] = rows["t_consumed"] = np.nan
            first = s.samples[a].append(rows)
            ev = np.zeros(1000, s.events.dtype)
            ev["agent"], ev["row"], ev["status"], ev["trainer_step"] = i, np.arange(first, first + 1000), GENERATED, -1
            s.events.append(ev)
        s.flush()
    s.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=200000, help="per agent")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base, path = Path(tmp) / "base.h5", Path(tmp) / "s.h5"
        make(base, args.samples)
        times, peaks = [], []
        for _ in range(args.reps):
            shutil.copy(base, path)
            tracemalloc.start()
            t = time.perf_counter()
            s = StoreFile(path, AGENTS, {})
            times.append(time.perf_counter() - t)
            peaks.append(tracemalloc.get_traced_memory()[1] / 1e6)
            tracemalloc.stop()
            s.f.close()
        print(f"re-open of {base.stat().st_size / 1e6:.0f} MB ({len(AGENTS)} x {args.samples} samples): "
              f"{statistics.median(times):.3f} s [{min(times):.3f}, {max(times):.3f}], peak "
              f"{statistics.median(peaks):.0f} MB [{min(peaks):.0f}, {max(peaks):.0f}] ({args.reps} reps)")


if __name__ == "__main__":
    main()
