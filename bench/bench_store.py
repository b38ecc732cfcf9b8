"""Experience-store write-through vs a raw h5py append of the same data, in one run.

    .venv/bin/python bench/bench_store.py [--steps 40] [--reps 5] [--warmup 1]

The workflow tree of the referential game is driven once (untimed) through `--steps`
steps exactly as the orchestrator drives it: admit a step, record each turn's generations
(rewards propagate, groups turn READY), take micro-batches (CONSUMED). That yields a trace
of what the store must record. Then, interleaved A/B/A/B `--reps` times:

  store : the real write-through (`Journal` + `StoreFile`) replays the trace: sample rows,
          token pools, events, in-place status patches and the commit protocol, flushed
          where the orchestrator flushes: once per micro-batch before the trainer sees it
          (`flush(full=False)`: one HDF5 flush; a generation batch's rows ride along with
          the next micro-batch's flush, a micro-batch's CONSUMED events with the next flush
          that writes other rows: docs/store.md, "Crash safety"), the same at every
          optimizer step of every agent, and a full commit (two HDF5 flushes) once a global
          step (the log line);
  raw   : plain h5py appends of the same sample rows and tokens (`resize` + slice write),
          no status changes, no events, no commit, the records built untimed beforehand:
          raw-col   one dataset per column (the v1 layout), flushed once per generation batch;
          raw-rec   one compound dataset per table (the v2 layout, h5py's high-level API),
                    flushed once per generation batch: plain append, the speed of h5py;
          raw-rec32 raw-rec with h5py's own Fletcher-32 filter on its datasets: the plain append
                    with the checksums the store's tables carry (schema 3), computed by HDF5;
          raw-recf  the same compound appends flushed at the store's flush points (once per
                    micro-batch, agent step and global step): as many flushes, but nothing new to write
                    at most of them (a flush of an unchanged file costs almost nothing);
          raw-all   every row the store appends (samples, tokens AND the /events rows of
                    each status change), buffered per table and appended + flushed at the
                    store's flush points: the I/O the durability contract needs, done by
                    plain h5py (no commit, no status patches, records prebuilt).

Prints samples/s of each and the ratios store/raw as median [min, max] over the reps, by
wall time and (raw-rec, raw-all) by this process's CPU time.
The goal (issue 13): store >= 0.8x raw h5py append; raw-all is the like-for-like baseline
(same rows, same flushes), raw-rec the plain append with no durability contract at all.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import h5py
import numpy as np

from flexmarl_hpc.workflows.build import build_task
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.orchestrator.experience import Journal
from flexmarl_hpc.store.tables import StoreFile
from flexmarl_hpc.store.schema import CONSUMED
from flexmarl_hpc.orchestrator.tree import Tree

ROOT = Path(__file__).resolve().parents[1]


def trace(cfg, task, steps: int) -> list[tuple]:
    """Run the real tree; return the ops the store sees: ("gen", Changes, version, replica),
    ("take", step, nodes), ("stepped", agent) and ("logged", step)."""
    tree = Tree(cfg, task)
    rng = np.random.default_rng(0)
    ops: list[tuple] = []
    for step in range(steps):
        tree.admit_step(step)
        for agent in cfg.agent_names:                      # turn order == agent order here
            nodes = list(tree.pending[agent])
            tree.pending[agent].clear()
            turn = cfg.workflow.turns[nodes[0].turn]
            batch = [(nd, rng.integers(3, len(task.vocab), turn.max_new_tokens).tolist(),
                      [-1.0] * turn.max_new_tokens) for nd in nodes]
            ops.append(("gen", tree.record_generation(batch, step, 0), step, 0))   # version, replica
        for agent in cfg.agent_names:
            while take := tree.take_ready(agent, step, cfg.trainer.micro_batch_size):
                ops.append(("take", step, take))
            ops.append(("stepped", agent))
        ops.append(("logged", step))
        tree.forget_step(step)
    return ops


def run_store(cfg, ops, path: Path) -> int:
    store = StoreFile(path, cfg.agent_names, {}, chunk=cfg.store.chunk_rows)
    j = Journal(store)
    n = 0
    for op in ops:
        now = store.now()
        if op[0] == "gen":                                # as Experience.record_generation:
            j.changes(op[1], now, *op[2:])
            n += len(op[1].generated)
        elif op[0] == "take":                             # as Experience.take_ready:
            j.status(op[2], CONSUMED, now, op[1])
            store.flush(full=False)                        # durable before the trainer sees it
        elif op[0] == "stepped":
            store.flush(full=False)                        # as on_stepped
        else:
            store.flush()                                  # as the log line: a full commit
    store.close()
    return n


def raw_batches(cfg, ops, path: Path) -> list[dict]:
    """The sample records and token records of each generation batch, per agent (built
    with the store's own code once, untimed: the raw side only appends them)."""
    store = StoreFile(path, cfg.agent_names, {}, chunk=cfg.store.chunk_rows)
    j = Journal(store)
    out = []
    for op in ops:
        if op[0] == "gen":
            j.generated(op[1].generated, 0.0, *op[2:])
            out.append({a: (np.concatenate(store.samples[a].buf), np.concatenate(store.tokens[a].buf))
                        for a in cfg.agent_names if store.samples[a].buf})
            for t in (*store.samples.values(), *store.tokens.values()):
                t.buf, t.disk = [], t.n            # as if written
    store.f.close()
    return out


def run_raw(cfg, ops, batches, path: Path, per_column: bool, flush_per_micro: bool,
            fletcher32: bool = False) -> int:
    f = h5py.File(path, "w", libver="latest")
    chunk = cfg.store.chunk_rows
    ds = {}
    for a in cfg.agent_names:
        rec, tok = batches[0][cfg.agent_names[0]]
        for table, dt, ch in (("samples", rec.dtype, chunk), ("tokens", tok.dtype, 8 * chunk)):
            names = dt.names if per_column else (None,)
            for name in names:
                sub = dt[name] if name else dt
                ds[a, table, name] = f.create_dataset(f"{table}/{a}/{name}" if name else f"{table}/{a}",
                                                      (0,), maxshape=(None,), dtype=sub, chunks=(ch,),
                                                      fletcher32=fletcher32)
    f.swmr_mode = True
    n = 0
    it = iter(batches)
    for op in ops:
        if op[0] != "gen":
            if flush_per_micro:
                f.flush()                                  # once per micro-batch and step
            continue
        for a, (rec, tok) in next(it).items():
            for table, arr in (("samples", rec), ("tokens", tok)):
                for name in (arr.dtype.names if per_column else (None,)):
                    d = ds[a, table, name]
                    k = len(arr)
                    d.resize((len(d) + k,))
                    d[-k:] = arr[name] if name else arr
            n += len(rec)
        if not flush_per_micro:
            f.flush()
    f.close()
    return n


def raw_appends(cfg, ops, path: Path) -> list[dict]:
    """Per op, every row the store appends at it (samples, tokens, events; built with the
    store's own code once, untimed), coalesced per table as the store's flush does."""
    store = StoreFile(path, cfg.agent_names, {}, chunk=cfg.store.chunk_rows)
    j = Journal(store)
    out = []
    for op in ops:
        if op[0] == "gen":
            j.changes(op[1], 0.0, *op[2:])
        elif op[0] == "take":
            j.status(op[2], CONSUMED, 0.0, op[1])
        out.append({t.ds.name: (np.concatenate(t.buf), t.ds.chunks[0])
                    for t in store.tables.values() if t.buf})
        for t in store.tables.values():
            t.buf, t.patches, t.disk = [], [], t.n      # as if written
    store.f.close()
    return out


def run_raw_all(ops, appends: list[dict], path: Path) -> int:
    """Plain h5py appends of every row the store appends, buffered per table until the
    store's flush points (per micro-batch and per step) and flushed there: the I/O the
    durability contract needs, at h5py's speed, without commit, patches or journal."""
    f = h5py.File(path, "w", libver="latest")
    ds = {name: f.create_dataset(name, (0,), maxshape=(None,), dtype=arr.dtype, chunks=(ch,))
          for app in appends for name, (arr, ch) in app.items() if name not in f}
    f.swmr_mode = True
    n, buf = 0, {}
    for op, app in zip(ops, appends):
        for name, (arr, _) in app.items():
            buf.setdefault(name, []).append(arr)
        if op[0] == "gen":
            n += len(op[1].generated)
            continue
        for name, arrs in buf.items():
            arr = np.concatenate(arrs)
            d = ds[name]
            d.resize((len(d) + len(arr),))
            d[-len(arr):] = arr
        buf = {}
        f.flush()
    f.close()
    return n


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}, {max(xs):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds of every side first")
    args = ap.parse_args()
    # the workload the README's store figures were measured on (the default config's game then)
    cfg = load_config(ROOT / "configs" / "local.yaml", ["workflow.task_args.num_objects=8",
                                                        "workflow.inputs_per_step=8", "run.eval_every=0"])
    task = build_task(cfg)
    t = time.perf_counter()
    ops = trace(cfg, task, args.steps)
    t_tree = time.perf_counter() - t
    rate = {"store": [], "raw-col": [], "raw-rec": [], "raw-rec32": [], "raw-recf": [], "raw-all": []}
    cpu = {name: [] for name in rate}        # samples per CPU second of this process (see below)
    with tempfile.TemporaryDirectory() as tmp:
        batches = raw_batches(cfg, ops, Path(tmp) / "prep.h5")
        appends = raw_appends(cfg, ops, Path(tmp) / "prep2.h5")
        sides = {"store": lambda p: run_store(cfg, ops, p),
                 "raw-col": lambda p: run_raw(cfg, ops, batches, p, True, False),
                 "raw-rec": lambda p: run_raw(cfg, ops, batches, p, False, False),
                 "raw-rec32": lambda p: run_raw(cfg, ops, batches, p, False, False, True),
                 "raw-recf": lambda p: run_raw(cfg, ops, batches, p, False, True),
                 "raw-all": lambda p: run_raw_all(ops, appends, p)}
        for rep in range(-args.warmup, args.reps):             # rep < 0: warm-up (first-call costs)
            for name, fn in sides.items():                # interleaved: drift hits every side
                p = Path(tmp) / f"{name}{rep}.h5"
                t, c = time.perf_counter(), time.process_time()
                n = fn(p)
                if rep >= 0:
                    rate[name].append(n / (time.perf_counter() - t))
                    cpu[name].append(n / (time.process_time() - c))
                p.unlink()
    n_gen, n_micro = sum(o[0] == "gen" for o in ops), sum(o[0] == "take" for o in ops)
    n_step, n_log = sum(o[0] == "stepped" for o in ops), sum(o[0] == "logged" for o in ops)
    print(f"experience store, referential game, {args.steps} steps ({n} samples, {n_gen} generation "
          f"batches; store flushes: {n_micro} per micro-batch + {n_step} per agent step + "
          f"{n_log} full per global step), {args.reps} interleaved reps after {args.warmup} untimed")
    print(f"  (the workflow tree itself, untimed below: {n / t_tree:.0f} samples/s)")
    for name, xs in rate.items():
        print(f"  {name:9s}: {statistics.median(xs):9.0f} samples/s  [{min(xs):.0f}, {max(xs):.0f}]")
    for raw in ("raw-col", "raw-rec", "raw-rec32", "raw-recf", "raw-all"):
        ratios = [s / r for s, r in zip(rate["store"], rate[raw])]
        print(f"  ratio store/{raw}: {spread(ratios)}")
    # every side runs in this one thread (the writes land in the page cache: their system
    # time counts too), so per CPU second is what each costs, and other jobs on a shared
    # machine shift it much less than wall time
    for raw in ("raw-rec", "raw-all"):
        ratios = [s / r for s, r in zip(cpu["store"], cpu[raw])]
        print(f"  ratio store/{raw} per CPU second: {spread(ratios)}")


if __name__ == "__main__":
    main()
