"""Copy every verifiable committed row of a damaged store into a new one, and say what was lost.

    python -m flexmarl_hpc.analyze salvage runs/local/local.h5 [--out NEW.h5]
    report = salvage(Path("runs/local/local.h5"), Path("runs/local/local.salvaged.h5"))

The damaged file is only read. A row in a chunk that fails its checksum is lost; so is a
sample whose tokens are, or whose life in /events cannot be told any more (an event chunk
is lost: every sample with a time stamp between the events either side of the hole, or
whose cached status the surviving events do not explain), and with a lost sample every
sample of its tree (same step and input, all agents), so the trees a resume rebuilds are
whole. The new store keeps row order; sample rows, token offsets, event rows and step row
lists are renumbered. The lost sample ids go to `<out>.lost.json`; docs/store.md says how
to resume from the salvaged store.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from flexmarl_hpc.store.checksum import (MUTABLE, Damage, StoreUnreadable, check_not_truncated, committed,
                                         damaged_chunks, has_checksums, open_bounded, verify_path)
from flexmarl_hpc.store.tables import StoreFile
from flexmarl_hpc.store.schema import CONSUMED


@dataclass
class Salvaged:
    """What salvage did: the new file, the damaged chunks, the lost rows and samples."""
    out: Path
    damage: list[Damage]
    lost_rows: dict[str, int] = field(default_factory=dict)        # table -> rows not copied
    lost_ids: dict[str, list[str]] = field(default_factory=dict)   # agent -> lost sample ids
    unreadable: dict[str, int] = field(default_factory=dict)       # agent -> lost rows, ids unknown
    truncated: str = ""                                            # the truncation notice, if cut

    def lines(self) -> list[str]:
        out = [f"salvage: {self.truncated}: the chunks past its end are lost"] if self.truncated else []
        out += [f"salvage: {len(self.damage)} damaged chunk(s): " + "; ".join(
            d.line() + (" (torn: a kill cut its rewrite; its committed rows verify)" if d.torn else "")
            for d in self.damage)]
        out += [f"salvage: {t}: {n} committed rows lost" for t, n in self.lost_rows.items() if n]
        for a, ids in self.lost_ids.items():
            if ids or self.unreadable.get(a):
                out.append(f"salvage: {a}: {len(ids)} samples lost (ids in {self.out}.lost.json)"
                           + (f", and {self.unreadable[a]} rows whose ids are in the damaged chunks"
                              if self.unreadable.get(a) else ""))
        out.append(f"salvage: wrote {self.out}")
        return out


def _good(n: int, bad: list[Damage], table: str) -> np.ndarray:
    """Which of a table's first n rows lie outside its damaged chunks."""
    ok = np.ones(n, bool)
    for d in bad:
        if d.table == table:
            ok[d.lo:d.hi] = False
    return ok


def _read(f: h5py.File, table: str, n: int, ok: np.ndarray) -> np.ndarray:
    """Rows [0, n) of a table, read chunk by chunk where they verify (zeros elsewhere)."""
    ds = f[table]
    out = np.zeros(n, ds.dtype)
    step = ds.chunks[0]
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        if ok[lo:hi].all():
            out[lo:hi] = ds[lo:hi]
    return out


def _torn_rows(f: h5py.File, d: Damage, out: np.ndarray, ok: np.ndarray) -> None:
    """The committed rows of a torn chunk (a kill cut its in-place rewrite; verification found
    them matching their crc record, their MUTABLE columns left out), read from its bytes into
    `out`. A table without MUTABLE columns (/events, /tokens, ...) keeps them (ok); in a
    patched one (/samples, /steps, /metrics) those columns may hold a torn value, so the rows
    stay lost, but a lost sample is then named by its id (verified bytes), not just counted."""
    ds = f[d.table]
    _, raw = ds.id.read_direct_chunk((d.lo,))
    out[d.lo:d.hi] = np.frombuffer(raw, ds.dtype, d.hi - d.lo)
    if not d.table.startswith(tuple(MUTABLE)):
        ok[d.lo:d.hi] = True


def _event_holes(ev: np.ndarray, ok: np.ndarray) -> list[tuple[float, float]]:
    """(t before, t after) of each run of lost events: their times lie between."""
    holes, n, i = [], len(ev), 0
    while i < n:
        if ok[i]:
            i += 1
            continue
        j = i
        while j < n and not ok[j]:
            j += 1
        holes.append((ev["t"][i - 1] if i else -np.inf, ev["t"][j] if j < n else np.inf))
        i = j
    return holes


def _unexplained(rows: np.ndarray, ev: np.ndarray) -> np.ndarray:
    """Rows whose cached status (and trainer_step) the given events do not end in."""
    if not len(ev):                     # no event left: no status is explained
        return np.ones(len(rows), bool)
    last = np.full(len(rows), -1, np.int64)
    last[ev["row"]] = np.arange(len(ev))
    has = last >= 0
    status = np.where(has, ev["status"][np.maximum(last, 0)], -1)
    tstep = np.where(has & (status == CONSUMED), ev["trainer_step"][np.maximum(last, 0)], -1)
    return (status != rows["status"]) | (tstep != rows["trainer_step"])


def _lost_samples(rows, ok, tok_ok, ev, ev_ok, agent_index) -> np.ndarray:
    """Which sample rows are lost: unreadable, tokens in a damaged chunk, or a life in
    /events that a hole in it makes unknown."""
    lost = ~ok
    end = rows["token_offset"] + rows["prompt_len"] + rows["response_len"]
    bad_tok = np.concatenate([[0], np.cumsum(~tok_ok)])            # damaged tokens before i
    inside = (rows["token_offset"] >= 0) & (end <= len(tok_ok))
    lost |= ~inside | (bad_tok[np.minimum(end, len(tok_ok))] - bad_tok[np.clip(rows["token_offset"], 0,
                                                                                 len(tok_ok))] > 0)
    holes = _event_holes(ev, ev_ok)
    for t0, t1 in holes:
        for col in ("t_generated", "t_ready", "t_consumed"):
            lost |= (rows[col] >= t0) & (rows[col] <= t1)
    if holes:
        mine = ev[ev_ok & (ev["agent"] == agent_index)]
        lost |= _unexplained(rows, mine[mine["row"] < len(rows)])
    return lost


def _trees(samples: dict, lost: dict) -> dict:
    """With a lost sample, every sample of its tree (same step and input, any agent)."""
    gone = set()
    for a, rows in samples.items():
        m = lost[a] & _good_ids(rows)
        gone |= set(zip(rows["step"][m].tolist(), rows["input_id"][m].tolist()))
    return {a: lost[a] | np.fromiter(((s, i) in gone for s, i in zip(rows["step"].tolist(),
                                                                      rows["input_id"].tolist())),
                                     bool, len(rows)) for a, rows in samples.items()}


def _in_trees(episodes: np.ndarray, samples: dict, lost: dict) -> np.ndarray:
    """Which /episodes rows belong to a tree (step, input) that lost samples."""
    gone = set()
    for a, rows in samples.items():
        m = lost[a] & _good_ids(rows)       # a row of a damaged chunk reads zeros: no tree known
        gone |= set(zip(rows["step"][m].tolist(), rows["input_id"][m].tolist()))
    return np.fromiter(((s, i) in gone for s, i in zip(episodes["step"].tolist(),
                                                        episodes["input_id"].tolist())), bool, len(episodes))


def _good_ids(rows: np.ndarray) -> np.ndarray:
    return rows["sample_id"] != b""


def salvage(src: Path, out: Path) -> Salvaged:
    """Copy the verifiable committed rows of `src` into a new store `out` (see the module
    docstring); `src` is only read. Raises ValueError (one line) where it cannot."""
    src, out = Path(src), Path(out)
    if out.exists():
        raise ValueError(f"{out}: exists; salvage writes a new file (name another with --out)")
    attrs, chunk, bad, ok, data = _load(src)
    agents = [str(a) for a in attrs["agents"]]
    rep = Salvaged(out, bad, truncated=_truncated(src))
    samples = {a: data[f"/samples/{a}"] for a in agents}
    lost = {a: _lost_samples(samples[a], ok[f"/samples/{a}"], ok[f"/tokens/{a}"], data["/events"],
                             ok["/events"], i) for i, a in enumerate(agents)}
    lost = _orphans(samples, _trees(samples, lost), any((~ok[f"/samples/{a}"]).any() for a in agents))
    for a in agents:
        rep.lost_ids[a] = sorted(x.decode() for x in samples[a]["sample_id"][lost[a] & _good_ids(samples[a])])
        rep.unreadable[a] = int((~ok[f"/samples/{a}"] & ~_good_ids(samples[a])).sum())
    if "/episodes" in data:                # an episode whose samples are lost is not counted
        ok["/episodes"] &= ~_in_trees(data["/episodes"], samples, lost)
    rep.lost_rows = {t: int((~m).sum()) for t, m in ok.items()}
    _write(out, agents, attrs, chunk, data, ok, lost)
    out.with_name(out.name + ".lost.json").write_text(json.dumps(
        {"source": str(src), "damaged": [d.line() for d in bad], "lost_sample_ids": rep.lost_ids,
         "lost_rows": rep.lost_rows, "unreadable_sample_rows": rep.unreadable}, indent=1))
    verify_path(out)
    return rep


def _truncated(src: Path) -> str:
    """The one-line truncation notice of src ('' for a whole file): its cut-off chunks are
    reported as damaged, this says why."""
    try:
        check_not_truncated(src)
    except StoreUnreadable as e:
        return str(e)
    return ""


def _load(src: Path):
    """(file attributes, rows per sample chunk, damaged chunks, verified-row masks, rows) of
    src, read with bounded metadata retries (open_bounded): a truncated or damaged file is
    read in seconds, and what HDF5 cannot read at all (the root group, /commit, a table's
    header) is refused in one line naming it."""
    with open_bounded(src) as f:
        if f.attrs.get("program") != "flexmarl_hpc" or "commit" not in f:
            raise ValueError(f"{src}: not a flexmarl_hpc run file of schema version 3 or later")
        where = "/commit"
        try:
            counts = committed(f)
            if not has_checksums(f["events"]):
                raise ValueError(f"{src}: written without chunk checksums (schema version "
                                 f"{int(f.attrs.get('schema_version', 0))}): nothing to verify rows against")
            where = "its chunk checksums"
            bad = damaged_chunks(f, retries=0)          # no writer holds it: a bad chunk stays bad
            ok, data = {}, {}
            for t, k in counts.items():
                where = t
                if t in f:
                    ok[t] = _good(min(k, len(f[t])), bad, t)
                    data[t] = _read(f, t, len(ok[t]), ok[t])
            for d in bad:
                if d.torn and d.table in data:
                    _torn_rows(f, d, data[d.table], ok[d.table])
            attrs = {k: v for k, v in f.attrs.items()}
            chunk = f[f"samples/{attrs['agents'][0]}"].chunks[0]
        except (OSError, RuntimeError, KeyError) as e:
            raise ValueError(f"{src}: {where} cannot be read (its HDF5 metadata lies in damaged or "
                             f"missing bytes: {' '.join(str(e).split())[:120]}); nothing was written") from None
    return attrs, chunk, bad, ok, data


def _orphans(samples: dict, lost: dict, unreadable: bool) -> dict:
    """With a lost sample, its children (parent_id its id, or "<agent>/<id>" for an episode
    call), theirs, and their trees: a kept child of a lost parent answers a prompt the store
    no longer holds. A parent id found nowhere counts as lost only where some sample rows
    are unreadable (it may be one of them)."""
    while True:
        keep = _ids(samples, {a: ~m for a, m in lost.items()})
        gone = _ids(samples, lost)
        new = {a: lost[a] | _good_ids(r) & np.fromiter(
            (p != b"" and p not in keep and (unreadable or p in gone) for p in r["parent_id"].tolist()),
            bool, len(r)) for a, r in samples.items()}
        new = _trees(samples, new)
        if all((new[a] == lost[a]).all() for a in samples):
            return lost
        lost = new


def _ids(samples: dict, mask: dict) -> set[bytes]:
    """The ids of the readable rows `mask` selects, bare and as "<agent>/<id>"."""
    out: set[bytes] = set()
    for a, r in samples.items():
        ids = r["sample_id"][mask[a] & _good_ids(r)].tolist()
        out.update(ids)
        out.update(f"{a}/".encode() + x for x in ids)
    return out


def _write(out: Path, agents: list[str], attrs: dict, chunk: int, data: dict, ok: dict, lost: dict) -> None:
    """The new store: kept samples renumbered, their tokens packed, events, steps and
    step rows remapped, the other tables' verifiable rows as they are."""
    s = StoreFile(out, agents, {k: v for k, v in attrs.items() if k != "schema_version"}, chunk=chunk)
    try:
        newrow = {}
        for a in agents:
            newrow[a] = _copy_samples(s, a, data[f"/samples/{a}"], data[f"/tokens/{a}"], ~lost[a])
            _copy_steps(s, a, data, ok, newrow[a])
        ev = data["/events"][ok["/events"]]
        keep = np.zeros(len(ev), bool)
        rows = ev["row"].copy()
        for i, a in enumerate(agents):
            mine = ev["agent"] == i
            m = newrow[a]
            inside = mine & (ev["row"] >= 0) & (ev["row"] < len(m))
            rows[inside] = m[ev["row"][inside]]
            keep |= inside & (rows >= 0)
        ev, ev["row"] = ev[keep], rows[keep]
        s.events.append(ev)
        for t in ("intervals", "metrics", "eval", "tools", "episodes", "failures"):
            if f"/{t}" in data:             # an older source has no /tools, /episodes (3), /failures (4)
                s.tables[f"/{t}"].append(data[f"/{t}"][ok[f"/{t}"]])
        s.flush()
    finally:
        s.close()


def _copy_samples(s: StoreFile, a: str, rows: np.ndarray, toks: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Append the kept sample rows and their tokens (packed); returns old row -> new (-1)."""
    kept = rows[keep].copy()
    lens = (kept["prompt_len"] + kept["response_len"]).astype(np.int64)
    starts = kept["token_offset"].astype(np.int64)
    idx = np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
    s.tokens[a].append(toks[idx])
    kept["token_offset"] = np.cumsum(lens) - lens
    s.samples[a].append(_as_written(kept, s.samples[a].dtype))
    newrow = np.full(len(rows), -1, np.int64)
    newrow[keep] = np.arange(int(keep.sum()))
    return newrow


def _as_written(rows: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Rows of an older schema as this release's records, by column name: a column the
    source lacks (schema.SAMPLE_SINCE) is 0 (numpy converts records by position)."""
    if rows.dtype == dtype:
        return rows
    out = np.zeros(len(rows), dtype)
    for name in rows.dtype.names:
        out[name] = rows[name]
    return out


def _copy_steps(s: StoreFile, a: str, data: dict, ok: dict, newrow: np.ndarray) -> None:
    """The verifiable /steps rows, each with its row list remapped (lost samples left out);
    a row list in a damaged chunk is rebuilt from the samples' trainer_step."""
    steps = data[f"/steps/{a}"][ok[f"/steps/{a}"]].copy()
    pool, pool_ok = data[f"/step_rows/{a}"], ok[f"/step_rows/{a}"]
    rows = data[f"/samples/{a}"]
    lists = []
    for st in steps:
        lo, k = int(st["rows_offset"]), int(st["rows_len"])
        if lo + k <= len(pool) and pool_ok[lo:lo + k].all():
            old = pool[lo:lo + k]
        else:
            old = np.nonzero((rows["status"] == CONSUMED) & (rows["trainer_step"] == st["step"]))[0]
        new = newrow[old[(old >= 0) & (old < len(newrow))]]
        lists.append(new[new >= 0])
    lens = np.array([len(x) for x in lists], np.int64)
    steps["rows_offset"], steps["rows_len"] = np.cumsum(lens) - lens, lens
    s.step_rows[a].append(np.concatenate(lists) if lists else np.zeros(0, np.int64))
    s.steps[a].append(steps)
