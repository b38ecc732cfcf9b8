"""Time `analyze` (summary + all figures) on a synthetic run file of 1e6 samples.

    .venv/bin/python bench/bench_analyze.py [--samples 1000000]

The file is written through the real StoreFile (same schema and chunking as a run), in
big appends, then `python -m flexmarl_hpc.analyze FILE --out DIR` is timed in-process.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from flexmarl_hpc.analyze import main as analyze
from flexmarl_hpc.store.tables import StoreFile
from flexmarl_hpc.store.schema import METRIC_COLUMNS, SAMPLE_COLUMNS, STEP_COLUMNS


def synth(path: Path, n: int, agents=("speaker", "listener"), ranks=6) -> None:
    rng = np.random.default_rng(0)
    store = StoreFile(path, list(agents), {"mode": "flex", "world_size": ranks,
                                           "config_yaml": "run: {steps: 1000}\n"})
    per, steps = n // len(agents), 1000
    for a in agents:
        k = per
        cols = {c: np.zeros(k, dtype=dt) for c, dt in SAMPLE_COLUMNS.items()}
        cols["sample_id"] = np.char.encode(np.arange(k).astype(str))
        cols["step"] = np.arange(k) * steps // k
        cols["policy_version"] = cols["step"] - (rng.random(k) < 0.3)
        cols["trainer_step"] = cols["step"]
        cols["status"][:] = 2
        cols["reward"] = rng.random(k)
        cols["response_len"] = rng.geometric(0.1, k).astype("i4")
        cols["prompt_len"][:] = 3
        cols["token_offset"] = np.r_[0, np.cumsum(3 + cols["response_len"])[:-1]]
        store.samples[a].append(cols)
        st = {c: np.zeros(steps, dtype=dt) for c, dt in STEP_COLUMNS.items()}
        st["step"] = np.arange(steps)
        st["reward_mean"] = np.linspace(0.1, 1, steps) + 0.05 * rng.standard_normal(steps)
        st["entropy"] = np.linspace(2, 0.2, steps)
        store.steps[a].append(st)
    m = 100_000
    t0 = np.sort(rng.random(m) * 600)
    store.intervals.append({"rank": rng.integers(1, ranks, m), "role": np.where(rng.random(m) < .5, b"rollout", b"trainer"),
                            "activity": rng.choice([b"generate", b"train", b"sync", b"wait"], m),
                            "agent": rng.choice([a.encode() for a in agents], m), "t0": t0, "t1": t0 + 0.01})
    mt = {c: np.zeros(steps, dtype=dt) for c, dt in METRIC_COLUMNS.items()}
    mt["step"] = np.arange(steps)
    mt["t"] = np.linspace(1, 600, steps)
    store.metrics.append(mt)
    store.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1_000_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.h5"
        t = time.perf_counter()
        synth(path, args.samples)
        print(f"wrote {args.samples} samples in {time.perf_counter() - t:.1f} s")
        t = time.perf_counter()
        rc = analyze([str(path), "--out", str(Path(tmp) / "figs")])
        print(f"analyze ({args.samples} samples, 100k intervals, all figures): {time.perf_counter() - t:.1f} s, exit {rc}")


if __name__ == "__main__":
    main()
