"""Experience-store write-through vs a raw h5py append of the same data, in one run.

    .venv/bin/python bench/bench_store.py [--steps 40]

"store": the orchestrator's real path for the referential game: admit a step, record every
turn's generations (rows + token pools + events), propagate rewards, write READY, take
micro-batches (CONSUMED, flushed per micro-batch). "raw": the same columns appended with
plain h5py (`resize` + slice write per column, same batch sizes, no status updates).
Prints samples/s for both and the ratio.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import h5py
import numpy as np

from flexmarl_hpc.config import load_config
from flexmarl_hpc.experience import Experience
from flexmarl_hpc.store import SAMPLE_COLUMNS, StoreFile
from flexmarl_hpc.build import build_task

ROOT = Path(__file__).resolve().parents[1]


def run_store(cfg, task, path: Path, steps: int) -> int:
    store = StoreFile(path, cfg.agent_names, {}, chunk=cfg.store.chunk_rows)
    exp = Experience(cfg, task, store)
    rng = np.random.default_rng(0)
    n = 0
    for step in range(steps):
        exp.admit_step(step)
        for agent in cfg.agent_names:                      # turn order == agent order here
            nodes = list(exp.pending[agent])
            exp.pending[agent].clear()
            turn = cfg.workflow.turns[nodes[0].turn]
            batch = [(nd, rng.integers(3, len(task.vocab), turn.max_new_tokens).tolist(),
                      [-1.0] * turn.max_new_tokens) for nd in nodes]
            exp.record_generation(batch, step, 0)
            store.flush()
            n += len(nodes)
        for agent in cfg.agent_names:
            while exp.take_ready(agent, step, cfg.trainer.micro_batch_size):
                pass
        exp.forget_step(step)
    store.close()
    return n


def run_raw(cfg, path: Path, steps: int) -> int:
    f = h5py.File(path, "w", libver="latest")
    cols = {}
    for agent in cfg.agent_names:
        g = f.create_group(agent)
        for name, dt in {**SAMPLE_COLUMNS, "tokens": "i4", "logprobs": "f4"}.items():
            cols[agent, name] = g.create_dataset(name, (0,), maxshape=(None,), dtype=dt,
                                                 chunks=(cfg.store.chunk_rows,))
    f.swmr_mode = True
    n = 0
    width = cfg.workflow.inputs_per_step
    for _ in range(steps):
        w = width
        for turn in cfg.workflow.turns:
            w *= turn.samples
            k, ntok = w, w * (2 + turn.max_new_tokens)
            for name, dt in SAMPLE_COLUMNS.items():
                d = cols[turn.agent, name]
                d.resize((len(d) + k,))
                d[-k:] = np.zeros(k, dtype=dt)
            for name in ("tokens", "logprobs"):
                d = cols[turn.agent, name]
                d.resize((len(d) + ntok,))
                d[-ntok:] = 0
            f.flush()
            n += k
    f.close()
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    cfg = load_config(ROOT / "configs" / "local.yaml")
    task = build_task(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        n_store = run_store(cfg, task, Path(tmp) / "store.h5", a.steps)
        t_store = time.perf_counter() - t
        t = time.perf_counter()
        n_raw = run_raw(cfg, Path(tmp) / "raw.h5", a.steps)
        t_raw = time.perf_counter() - t
    s, r = n_store / t_store, n_raw / t_raw
    print(f"experience store, referential game, {a.steps} steps ({n_store} samples)")
    print(f"  store write-through : {s:10.0f} samples/s")
    print(f"  raw h5py append     : {r:10.0f} samples/s")
    print(f"  ratio store/raw     : {s / r:.2f}")


if __name__ == "__main__":
    main()
