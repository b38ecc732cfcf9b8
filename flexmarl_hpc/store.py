"""HDF5 write-through of the experience store (schema below; README documents it too).

One writer (the orchestrator rank) owns the file. Every table is a group of equal-length
1-D chunked, resizable datasets (one per column), created up front so the file can switch
to SWMR mode: `h5py.File(path, "r", swmr=True)` reads it while the run writes, and
`flush()` runs after every micro-batch. Variable-length data (tokens, log-probs, the sample
rows of a step) live in flat pools addressed by (offset, length) columns: no pickles, no
vlen types. Rows are only ever appended; a sample's status columns are updated in place
as it advances (generated -> ready -> consumed, or -> dropped when
pipeline.overprovision leaves its input out of the step), and every change is also appended to
/events so the history is never overwritten.

Schema version 1:

    /                      attrs: schema_version, program, created, config_yaml, agents, mode,
                                  world_size, t0 (epoch seconds; all times are relative to it)
    /samples/<agent>/      sample_id S64 ({input_id}_{turn}_{trajectory_id}), parent_id S64,
                           input_id i8, turn i4, traj i8, step i8, policy_version i8,
                           replica i4, status i1 (0 generated, 1 ready, 2 consumed, 3 dropped),
                           reward f4, advantage f4, trainer_step i8 (-1 until consumed),
                           t_generated f8, t_ready f8, t_consumed f8,
                           token_offset i8, prompt_len i4, response_len i4
                           tokens i4 / logprobs f4: flat pools, prompt then response per
                           sample; logprobs is NaN on prompt positions
    /steps/<agent>/        step i8, version i8 (after the step), t_end f8, n_samples i4,
                           n_micro i4, loss f4, reward_mean f4, entropy f4, kl f4,
                           grad_norm f4, staleness_max i4, staleness_mean f4,
                           rows_offset i8, rows_len i4; rows i8: flat pool of sample rows
    /intervals/            rank i4, role S16, activity S16, agent S32, t0 f8, t1 f8
    /events/               agent i2 (index into attrs agents), row i8, status i1, t f8,
                           trainer_step i8
    /metrics/              step i8, t f8, wall f8, samples i8, tokens i8, samples_per_s f4,
                           rollout_s f4, train_s f4, sync_s f4, swap_s f4, utilization f4,
                           staleness_max i4
"""
from __future__ import annotations

import time
from pathlib import Path

import h5py
import numpy as np

SCHEMA_VERSION = 1
GENERATED, READY, CONSUMED, DROPPED = 0, 1, 2, 3
STATUS_NAMES = {GENERATED: "generated", READY: "ready", CONSUMED: "consumed", DROPPED: "dropped"}

SAMPLE_COLUMNS = {
    "sample_id": "S64", "parent_id": "S64", "input_id": "i8", "turn": "i4", "traj": "i8",
    "step": "i8", "policy_version": "i8", "replica": "i4", "status": "i1", "reward": "f4",
    "advantage": "f4", "trainer_step": "i8", "t_generated": "f8", "t_ready": "f8",
    "t_consumed": "f8", "token_offset": "i8", "prompt_len": "i4", "response_len": "i4",
}
STEP_COLUMNS = {
    "step": "i8", "version": "i8", "t_end": "f8", "n_samples": "i4", "n_micro": "i4",
    "loss": "f4", "reward_mean": "f4", "entropy": "f4", "kl": "f4", "grad_norm": "f4",
    "staleness_max": "i4", "staleness_mean": "f4", "rows_offset": "i8", "rows_len": "i4",
}
INTERVAL_COLUMNS = {"rank": "i4", "role": "S16", "activity": "S16", "agent": "S32",
                    "t0": "f8", "t1": "f8"}
EVENT_COLUMNS = {"agent": "i2", "row": "i8", "status": "i1", "t": "f8", "trainer_step": "i8"}
METRIC_COLUMNS = {
    "step": "i8", "t": "f8", "wall": "f8", "samples": "i8", "tokens": "i8",
    "samples_per_s": "f4", "rollout_s": "f4", "train_s": "f4", "sync_s": "f4", "swap_s": "f4",
    "utilization": "f4", "staleness_max": "i4",
}


class Table:
    """A group of equal-length resizable column datasets, appended to together."""

    def __init__(self, group: h5py.Group, columns: dict[str, str], chunk: int, pools: dict[str, str] = {}):
        self.group = group
        self.columns = columns
        for name, dt in {**columns, **pools}.items():
            if name not in group:
                group.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(chunk,))
        self.ds = {name: group[name] for name in {**columns, **pools}}
        self.n = len(self.ds[next(iter(columns))])

    def append(self, rows: dict[str, np.ndarray | list]) -> int:
        """Append equal-length column arrays; returns the first new row index."""
        k = len(next(iter(rows.values())))
        if set(rows) != set(self.columns):
            missing = set(self.columns) - set(rows)
            raise KeyError(f"{self.group.name}: append is missing columns {sorted(missing)}")
        first = self.n
        for name, vals in rows.items():
            d = self.ds[name]
            d.resize((first + k,))
            d[first:first + k] = np.asarray(vals, dtype=self.columns[name])
        self.n = first + k
        return first

    def extend_pool(self, name: str, values: np.ndarray) -> int:
        d = self.ds[name]
        off = len(d)
        d.resize((off + len(values),))
        d[off:] = values
        return off

    def update(self, name: str, rows: np.ndarray, values) -> None:
        """In-place update of one column at (sorted or unsorted) row indices."""
        rows = np.asarray(rows, dtype=np.int64)
        vals = np.broadcast_to(np.asarray(values, dtype=self.columns[name]), rows.shape)
        order = np.argsort(rows)                     # h5py fancy indexing needs increasing rows
        self.ds[name][rows[order]] = vals[order]


class StoreFile:
    """The run's HDF5 file: creates or re-opens (append mode, for resume) and writes."""

    def __init__(self, path: Path, agents: list[str], attrs: dict, chunk: int = 1024):
        self.path = Path(path)
        self.agents = list(agents)
        fresh = not self.path.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = h5py.File(self.path, "a", libver="latest")
        if fresh:
            self.f.attrs.update({"schema_version": SCHEMA_VERSION, "program": "flexmarl_hpc",
                                 "created": time.time(), "t0": time.time(), "agents": self.agents,
                                 **attrs})
        else:
            check_file(self.f, self.path)
            if list(self.f.attrs["agents"]) != self.agents:
                raise ValueError(f"{self.path}: written for agents {list(self.f.attrs['agents'])}, "
                                 f"this run has {self.agents}")
        self.t0 = float(self.f.attrs["t0"])
        self.samples = {a: Table(self.f.require_group(f"samples/{a}"), SAMPLE_COLUMNS, chunk,
                                 {"tokens": "i4", "logprobs": "f4"}) for a in self.agents}
        self.steps = {a: Table(self.f.require_group(f"steps/{a}"), STEP_COLUMNS, 256, {"rows": "i8"})
                      for a in self.agents}
        self.intervals = Table(self.f.require_group("intervals"), INTERVAL_COLUMNS, 4096)
        self.events = Table(self.f.require_group("events"), EVENT_COLUMNS, 4096)
        self.metrics = Table(self.f.require_group("metrics"), METRIC_COLUMNS, 256)
        self.f.swmr_mode = True

    def now(self) -> float:
        return time.time() - self.t0

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        if self.f.id.valid:
            self.f.flush()
            self.f.close()


def check_file(f: h5py.File, path) -> None:
    """Refuse a file that is not ours or is of another schema version, saying which."""
    if f.attrs.get("program") != "flexmarl_hpc":
        raise ValueError(f"{path}: not a flexmarl_hpc run file (no program=flexmarl_hpc attribute)")
    v = int(f.attrs.get("schema_version", -1))
    if v != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema version {v}; this flexmarl_hpc reads version {SCHEMA_VERSION}")
