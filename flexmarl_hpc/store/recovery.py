"""What a resume's re-open of the store will repair, found before it writes a byte.

    plan = check_reopen(path, agents, table_names(agents))   # raises, or the repairs to make
    plan.lines()                                              # what they are, for the log

A resume validates, then writes: every reason to refuse the file (damage, a foreign or
other-schema file, other agents, tables or formats this release does not write, a count
past a table's rows, a sample whose parent row is gone) is found here, by reading only, so
a refused resume leaves the file byte-identical; `StoreFile` then makes the repairs this
plan names (docs/store.md, "Crash safety" and "Torn in-place writes"). The pre-launch check
(launch/preflight.py) runs the same check.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import h5py
import numpy as np

from flexmarl_hpc.store.checksum import (Damage, StoreInconsistent, committed, open_read, read_rows,
                                         verify_store)
from flexmarl_hpc.store.chunked import stored_as_written
from flexmarl_hpc.store.repair import open_flags
from flexmarl_hpc.store.schema import CONSUMED, READY, STATUS_FIELDS, check_file


@dataclass
class Recovery:
    """The repairs a re-open makes (none of them changes a committed fact: docs/store.md)."""
    flags: bool = False                                  # a killed writer's open-for-write flags
    torn: list[Damage] = field(default_factory=list)     # chunks to rewrite (torn, with evidence)
    cut: dict[str, int] = field(default_factory=dict)    # table -> uncommitted rows to discard
    # agent -> (rows, their status fields as the committed events say them), where they differ
    restatus: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    added: list[str] = field(default_factory=list)       # tables to add to /commit (empty)

    def lines(self) -> list[str]:
        out = ["cleared the open-for-write flags an unclean exit left"] if self.flags else []
        if self.added:
            out.append(f"added {', '.join(self.added)} to /commit")
        out += [f"rewrote the torn chunk of {d.table} rows {d.lo}-{d.hi - 1} (a kill cut its in-place "
                "write; its committed rows verified)" for d in self.torn]
        out += [f"discarded {n} uncommitted rows of {t}" for t, n in self.cut.items()]
        out += [f"restored the status of {len(idx)} {a} samples from /events"
                for a, (idx, _) in self.restatus.items()]
        return out


def check_reopen(path: Path, agents: list[str], tables: list[str]) -> Recovery:
    """Every check a resume's re-open makes before it changes the file (raises StoreDamaged,
    StoreUnreadable, StoreInconsistent or ValueError, one line naming what), and the
    repairs it will make. `tables`: this release's tables for `agents` (schema.table_names)."""
    with open_read(Path(path)) as f:
        check_file(f, path)
        verify_store(f, path, torn=(torn := []), counts=True)
        if list(f.attrs["agents"]) != list(agents):
            raise ValueError(f"{path}: written for agents {list(f.attrs['agents'])}, this run has {list(agents)}")
        counts = committed(f)
        added = _check_tables(f, path, counts, tables)
        cut = {}
        for name, keep in counts.items():
            if keep > len(f[name]):
                raise ValueError(f"{path}: /commit says {keep} rows of {name}, the file has "
                                 f"{len(f[name])} (damaged file)")
            if len(f[name]) > keep:
                cut[name] = len(f[name]) - keep
        # one agent's columns at a time, only those a check reads: what is held at once is
        # every agent's sample ids (the parents' pool), /events, and one agent's columns
        def rows_of(a: str, fields: tuple[str, ...]) -> np.ndarray:
            return read_rows(f[f"samples/{a}"], counts[f"/samples/{a}"], _of(torn, f"/samples/{a}"), fields)
        check_parents(path, {a: rows_of(a, ("sample_id",))["sample_id"] for a in agents},
                      lambda a: rows_of(a, PARENT_FIELDS))
        events = read_rows(f["events"], counts["/events"], _of(torn, "/events"))
        restatus = {}
        for i, a in enumerate(agents):
            idx, want = status_patch(rows_of(a, STATUS_FIELDS), events, i)
            if len(idx):
                restatus[a] = (idx, want)
    flags = open_flags(path)             # the superblock's own checksum checked too
    return Recovery(flags, torn, cut, restatus, added)


def _of(torn: list[Damage], table: str) -> list[Damage]:
    return [d for d in torn if d.table == table]


def _check_tables(f: h5py.File, path, counts: dict, tables: list[str]) -> list[str]:
    """The file's tables against this release's: /commit names no other, each is stored as
    this release writes it, and one it lacks (added by a later schema-5 release: /eval) is
    empty or absent. Returns the ones to add to /commit."""
    names = list(counts)
    added = [n for n in tables if n not in counts]
    if set(names) - set(tables) or any(n in f and len(f[n]) for n in added):
        raise ValueError(f"{path}: /commit names tables {names}, this flexmarl_hpc has {tables} (damaged file)")
    for n in tables:
        if n in f and not stored_as_written(f[n]):
            raise ValueError(f"{path}: {n} is not stored as the packed, Fletcher-32-checksummed "
                             "records this flexmarl_hpc writes (damaged file?)")
    return added


PARENT_FIELDS = ("sample_id", "parent_id", "step")


def check_parents(path, ids: dict[str, np.ndarray], rows_of: Callable[[str], np.ndarray]) -> None:
    """Every committed sample with a parent (`parent_id`: the parent's sample_id in a tree
    workflow, "<agent>/<sample_id>" for an episode call) has the parent's row: a child
    without one (a store salvaged by a release that kept orphans) cannot be replayed, so it
    is refused in one line naming it (StoreInconsistent). `ids`: each agent's sample ids
    (sorted here in place: the only copy held); `rows_of(agent)`: its PARENT_FIELDS, read
    when its turn comes."""
    for v in ids.values():
        v.sort()
    for a in ids:
        rows = rows_of(a)
        missing = np.flatnonzero(~_parents_found(rows["parent_id"], ids))
        if len(missing):
            r = rows[missing[0]]
            raise StoreInconsistent(
                f"{path}: {a} sample {r['sample_id'].decode()} (step {int(r['step'])}) has no parent row "
                f"({r['parent_id'].decode()}) in the store, and {len(missing) - 1} more; salvage it "
                "(python -m flexmarl_hpc.analyze salvage)")


def _parents_found(parents: np.ndarray, ids: dict[str, np.ndarray]) -> np.ndarray:
    """Which `parents` ("" included) name a row: a bare sample_id of any agent's, or
    "<agent>/<sample_id>" of that agent's. `ids` sorted: a binary search in each (a set of
    Python bytes took ~2.4 s for 400,000 samples, np.isin's hash of 64-byte strings ~1.4 s;
    one sorted pool of every agent's ids was a second copy of them)."""
    parents = np.ascontiguousarray(parents)          # a field of the records: strided
    found = parents == b""
    for mine in ids.values():
        found[~found] = _among(parents[~found], mine)
    width = parents.dtype.itemsize
    for b, mine in ids.items():
        pre = f"{b}/".encode()
        m = ~found & (parents.view(np.uint8).reshape(-1, width)[:, :len(pre)] == np.frombuffer(pre, np.uint8)).all(1) \
            if len(pre) <= width else np.zeros(len(parents), bool)
        if m.any():
            raw = parents[m].view(np.uint8).reshape(-1, width)
            bare = np.zeros_like(raw)
            bare[:, :width - len(pre)] = raw[:, len(pre):]
            found[m] = _among(bare.view(parents.dtype).ravel(), mine.astype(parents.dtype))
    return found


def _among(x: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """x in pool, elementwise, for a sorted pool."""
    if not len(pool):
        return np.zeros(len(x), bool)
    return pool[np.minimum(np.searchsorted(pool, x), len(pool) - 1)] == x


def status_patch(rows: np.ndarray, events: np.ndarray, agent_index: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows of `rows` (one agent's samples) whose status fields differ from what the
    committed `events` say, and those fields as the events say them (last event per row
    wins; reward/advantage/t_ready from the last READY event, trainer_step and t_consumed
    only while consumed): (row indices, their STATUS_FIELDS records)."""
    ev = events[events["agent"] == agent_index]
    if not len(rows):
        return np.zeros(0, np.int64), rows[list(STATUS_FIELDS)]
    want = rows[list(STATUS_FIELDS)].copy()
    last = _last_per_row(ev["row"], len(rows))
    has = last >= 0
    e = ev[last[has]]
    want["status"][has] = e["status"]
    consumed = has.copy()
    consumed[has] = e["status"] == CONSUMED
    want["trainer_step"] = -1
    want["t_consumed"] = np.nan
    want["trainer_step"][consumed] = ev["trainer_step"][last[consumed]]
    want["t_consumed"][consumed] = ev["t"][last[consumed]]
    rd = ev[ev["status"] == READY]
    last_ready = _last_per_row(rd["row"], len(rows))
    hr = last_ready >= 0
    want["reward"] = np.nan
    want["advantage"] = np.nan
    want["t_ready"] = np.nan
    for name, src in (("reward", "reward"), ("advantage", "advantage"), ("t_ready", "t")):
        want[name][hr] = rd[src][last_ready[hr]]
    cur = rows[list(STATUS_FIELDS)]
    diff = np.zeros(len(rows), bool)
    for name in STATUS_FIELDS:
        a, b = cur[name], want[name]
        diff |= ~((a == b) | (np.isnan(a) & np.isnan(b)) if a.dtype.kind == "f" else a == b)
    idx = np.nonzero(diff)[0]
    return idx, want[idx]


def _last_per_row(rows: np.ndarray, n: int) -> np.ndarray:
    """Index of the last entry for each row 0..n-1 (-1 where none)."""
    last = np.full(n, -1, np.int64)
    last[rows] = np.arange(len(rows))           # numpy assigns in order: the last one wins
    return last
