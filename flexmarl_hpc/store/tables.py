"""The HDF5 store of a run: one writer (the orchestrator rank), SWMR readers.

    store = StoreFile(path, agents, attrs)    # created, or re-opened and repaired on resume
    store.samples[agent].append(rows)         # buffered
    store.flush(full=True)                    # written, committed, readable

The schema, the commit protocol and what a resume repairs are documented once, in
docs/store.md. This module defines the tables (one chunked 1-D dataset of a compound dtype
each, created up front so the file can switch to SWMR mode), buffers rows and in-place
patches in memory and writes them in `flush()`: a light flush per micro-batch before the
trainer sees it, a full flush (every table, HDF5 flush, /commit, flush again) at every
optimizer step, checkpoint and log line. Re-opening cuts every table back to its committed
rows, rebuilds the status fields from the committed /events and clears a killed writer's
open-for-write flags (`store.repair`).
"""
from __future__ import annotations

import time
from functools import partial
from operator import attrgetter
from pathlib import Path

import h5py
import numpy as np

from flexmarl_hpc.runtime import faults
from flexmarl_hpc.store.checksum import (CRC_DTYPE, MUTABLE, _weights, chunk_buffer, has_checksums,
                                         prefix_crc, span_sums, stamp, verify_path)
from flexmarl_hpc.store.repair import clear_open_flags

SCHEMA_VERSION = 4                 # 3: Fletcher-32 on every chunk; 4: /tools and /episodes
READS = (1, 2, 3, 4)                  # versions flexmarl_hpc.analysis.load reads
GENERATED, READY, CONSUMED, DROPPED = 0, 1, 2, 3
STATUS_NAMES = {GENERATED: "generated", READY: "ready", CONSUMED: "consumed", DROPPED: "dropped"}

SAMPLE_COLUMNS = {
    "sample_id": "S64", "parent_id": "S64", "input_id": "i8", "turn": "i4", "traj": "i8",
    "step": "i8", "policy_version": "i8", "replica": "i4", "status": "i1", "reward": "f4",
    "advantage": "f4", "trainer_step": "i8", "t_generated": "f8", "t_ready": "f8",
    "t_consumed": "f8", "token_offset": "i8", "prompt_len": "i4", "response_len": "i4",
}
TOKEN_COLUMNS = {"token": "i4", "logprob": "f4"}
STEP_COLUMNS = {
    "step": "i8", "version": "i8", "t_end": "f8", "n_samples": "i4", "n_micro": "i4",
    "loss": "f4", "reward_mean": "f4", "entropy": "f4", "kl": "f4", "grad_norm": "f4",
    "logp_mismatch": "f4", "tis_mean": "f4", "staleness_max": "i4", "staleness_mean": "f4",
    "rows_offset": "i8", "rows_len": "i4", "superseded": "i1", "clip_frac": "f4", "ppo_kl": "f4",
}
INTERVAL_COLUMNS = {"rank": "i4", "role": "S16", "activity": "S16", "agent": "S32",
                    "t0": "f8", "t1": "f8"}
EVENT_COLUMNS = {"agent": "i2", "row": "i8", "status": "i1", "t": "f8", "trainer_step": "i8",
                 "reward": "f4", "advantage": "f4"}
METRIC_COLUMNS = {
    "step": "i8", "t": "f8", "wall": "f8", "samples": "i8", "tokens": "i8",
    "samples_per_s": "f4", "rollout_s": "f4", "train_s": "f4", "sync_s": "f4", "swap_s": "f4",
    "utilization": "f4", "staleness_max": "i4", "superseded": "i1",
}
EVAL_COLUMNS = {
    "step": "i8", "agent": "S64", "metric": "S64", "mode": "S8", "value": "f8", "n_inputs": "i4",
    "n_paths": "i4", "version": "i8", "t_start": "f8", "t_end": "f8",
}

TOOL_COLUMNS = {"t": "f8", "agent": "i2", "input_id": "i8", "traj": "i8", "call": "i4",
                "tool": "S64", "outcome": "i1", "latency_s": "f4"}
# /tools outcome codes: the index here (append only). The sandbox's outcomes
# (tools.sandbox.OUTCOMES, also the pool's for a reward function), 'refused' (tools.registry:
# input a tool will not run) and 'reward_error' (a reward function returned, but no usable
# reward); docs/tools.md and docs/store.md say what each means
TOOL_OUTCOMES = ("ok", "error", "timeout", "killed_cpu", "memory", "file_size", "crashed",
                 "refused", "launch_failed", "reward_error")


def episode_columns(n_agents: int) -> dict[str, str]:
    """/episodes: one row per finished episode; `calls` and `reward` hold one entry per
    agent (attrs `agents` order), so the row's dtype depends on the run's agents."""
    return {"step": "i8", "input_id": "i8", "traj": "i8", "t": "f8",
            "calls": f"({n_agents},)i4", "reward": f"({n_agents},)f4"}


def eval_key(agent: str, metric: str, mode: str) -> str:
    """How an /eval row is named in logs, sinks and analyze: "agent/metric" (greedy) or
    "agent/metric/sample"; the task's own metrics (agent "") under "task"."""
    return f"{agent or 'task'}/{metric}" + ("" if mode == "greedy" else f"/{mode}")


# a column an append may leave out, and its value (anything else missing is an error)
DEFAULTS = {"superseded": 0, "logp_mismatch": np.nan, "tis_mean": np.nan,
            "reward": np.nan, "advantage": np.nan, "clip_frac": np.nan, "ppo_kl": np.nan}
# columns added within schema 2: a file written before lacks them, and a resume into it
# writes its rows without them (analysis reads them as NaN)
ADDED = {"clip_frac", "ppo_kl"}
# what an event sets in its sample's row (the rest of the row is written once)
STATUS_FIELDS = ("status", "reward", "advantage", "trainer_step", "t_ready", "t_consumed")
assert MUTABLE["/samples/"] == STATUS_FIELDS        # the prefix checksum leaves them out


class StoreError(OSError):
    """The store could not be written; the message is one line naming the file."""

    @classmethod
    def of(cls, path: Path, e: Exception) -> "StoreError":
        # h5py reports a full disk as a multi-line HDF5 error stack mentioning errno 28
        text = str(e)
        if getattr(e, "errno", None) == 28 or "errno = 28" in text or "No space left" in text:
            err = cls(f"{path}: no space left on device while writing the store; rows not yet "
                      "committed are discarded when the same command runs again")
            err.errno = 28
            return err
        return cls(f"{path}: cannot write the store: {' '.join(text.split())[:300]}")


OPEN_WAIT_S = 60.0
"""How long the writer's open of an existing store waits for other processes to close it."""


def open_for_write(path: Path, wait_s: float | None = None) -> h5py.File:
    """h5py.File(path, "a"), retried while another process has the file open. HDF5 locks
    the file at open without waiting: a reader (`status`, `analyze`, h5py in SWMR mode)
    holds a shared lock for the few ms it reads, and the writer's exclusive lock is then
    refused at once (errno 11). A requeued job whose store a `status --follow` was reading
    at that moment failed (tests/slurm/test_status.py). After `wait_s`: a StoreError."""
    wait_s = OPEN_WAIT_S if wait_s is None else wait_s
    end = time.monotonic() + wait_s
    while True:
        try:
            return h5py.File(path, "a", libver="latest")
        except BlockingIOError:
            if time.monotonic() >= end:
                raise StoreError(f"{path}: another process has had the store open for {wait_s:g} s "
                                 "(its HDF5 file lock refuses this writer); close it (an h5py "
                                 "session reading it?) and run the same command again") from None
            time.sleep(0.05)


def dtype_of(columns: dict[str, str]) -> np.dtype:
    return np.dtype([(k, v) for k, v in columns.items()])


class Table:
    """One compound-dtype dataset: buffered appends and in-place patches, written by
    `write()` (StoreFile.flush). `n` counts rows appended so far, written or not.

    Writes go to the file as whole chunks (`H5Dwrite_chunk`): the table keeps an image of
    its last few chunks, puts new rows and patches into them, and writes each touched
    chunk's bytes as they are, with the Fletcher-32 checksum the dataset's filter expects
    appended (`store.checksum`). That skips HDF5's per-write type-conversion path, whose
    fixed cost grows with the number of fields (~45 us for a /samples row set of any size,
    half that per chunk written directly), and it is the same I/O: HDF5 writes a chunk whole
    when it flushes it anyway. Chunks past the images (old rows a patch reaches) are read
    back first. Reads go through HDF5 as usual (a direct write evicts its chunk from the
    chunk cache)."""

    IMAGES = 4                      # chunk images kept: the live steps' rows are in the last ones

    def __init__(self, ds: h5py.Dataset, columns: dict[str, str] | None, mirror: bool = False,
                 dirty: set | None = None, created: tuple[np.dtype, int] | None = None):
        self.ds = ds
        self.dirty = set() if dirty is None else dirty      # the file's tables with work queued
        # the file's own type as the memory type of reads: HDF5 then copies records as they
        # are instead of converting a compound field by field
        self.ftype = ds.id.get_type()
        if created:                                         # just made from (dtype, chunk)
            (self.dtype, self.chunk), self.disk = created, 0
        else:                                               # a resume: check what the file has
            self.dtype, self.chunk, self.disk = ds.dtype, ds.chunks[0], len(ds)
            if self.ftype != h5py.h5t.py_create(self.dtype) or not has_checksums(ds) or \
                    ds.id.get_create_plist().get_nfilters() != 1:
                raise ValueError(f"{ds.file.filename}: {ds.name} is not stored as the packed, "
                                 f"Fletcher-32-checksummed {self.dtype} records this flexmarl_hpc "
                                 "writes (damaged file?)")
        if columns is not None:
            columns = {k: v for k, v in columns.items() if k not in ADDED or k in self.dtype.names}
        self.columns = columns
        self.n = self.disk
        self.buf: list[np.ndarray] = []
        self.patches: list[tuple[np.ndarray, dict]] = []
        self.mirror = mirror                  # a status cache: its patches may wait (flush)
        self._img: dict[int, tuple] = {}                     # chunk index -> _image()
        self._nbytes = self.chunk * self.dtype.itemsize       # a chunk's bytes (no checksum)
        self._queued_new = False              # a queued patch hits rows not yet written
        self._crc = (0, 0)                    # (count, prefix_crc of its boundary chunk's rows)
        self._full_crc = (-1, 0)              # (chunk, prefix_crc) of the last chunk a commit filled
        self.name = ds.name
        self.patched = self.name.startswith(tuple(MUTABLE))   # full chunks rewritten in place

    def append(self, rows: dict | np.ndarray) -> int:
        """Queue rows (a record array or a dict of equal-length columns); returns the first
        new row index."""
        arr = rows if isinstance(rows, np.ndarray) else self._records(rows)
        if arr.dtype != self.dtype:           # as an assignment into the chunk would convert
            arr = arr.astype(self.dtype)
        arr = np.ascontiguousarray(arr)       # write() copies its bytes
        first = self.n
        self.buf.append(arr)
        self.n += len(arr)
        self.dirty.add(self)
        return first

    def _records(self, cols: dict) -> np.ndarray:
        if self.columns is None:
            raise TypeError(f"{self.ds.name}: a pool takes an array, not columns")
        k = len(next(iter(cols.values())))
        missing = set(self.columns) - set(cols) - set(DEFAULTS)
        unknown = set(cols) - set(self.columns) - ADDED
        if missing or unknown:
            raise KeyError(f"{self.ds.name}: append is missing columns {sorted(missing)} "
                           f"or has unknown ones {sorted(unknown)}")
        out = np.empty(k, self.dtype)
        for name in self.columns:
            out[name] = cols[name] if name in cols else DEFAULTS[name]
        return out

    def patch(self, rows, fields: dict) -> None:
        """Update some fields of existing rows (any order): at once where they are all still
        buffered (the journal patches the rows it has just appended), else queued."""
        rows = np.asarray(rows, np.int64)
        if not len(rows):
            return
        if rows.min() >= self.disk and not self._queued_new:
            if len(self.buf) > 1:
                self.buf = [_join(self.buf, self.dtype)]
            _set(self.buf[0], rows - self.disk, fields)
            return
        # a scalar stays one (as _set and _patch_new treat it); lists become arrays
        fields = {k: v if isinstance(v, (np.ndarray, np.generic, int, float)) else np.asarray(v)
                  for k, v in fields.items()}
        if not self._queued_new and rows.max() >= self.disk:   # then later ones must queue too
            self._queued_new = True
        self.patches.append((rows, fields))
        self.dirty.add(self)

    def write(self, patch_disk: bool = True) -> None:
        """The new rows and the queued patches, as one resize and one direct write of each
        chunk they touch. `patch_disk=False` writes the new rows only (with the patches that
        hit them) and keeps the patches of rows already on disk queued."""
        if not self.buf and not self.patches:
            return
        pieces, self.buf = self.buf, []
        on_disk = self.patches
        if self._queued_new:                  # rare: patch() updates buffered rows itself
            pieces = [_join(pieces, self.dtype)] if len(pieces) > 1 else pieces
            on_disk = self._patch_new(pieces[0], on_disk) if pieces else on_disk
            self._queued_new = False
        self.patches = [] if patch_disk else on_disk
        # the new rows as bytes: numpy copies a compound record field by field (~6x slower)
        new = (pieces[0].view(np.uint8) if len(pieces) == 1 else
               np.concatenate([p.view(np.uint8) for p in pieces])) if pieces else None
        if patch_disk and on_disk:
            self._write_patched(on_disk, new)
        elif new is not None:
            self._write_rows(new)

    def _write_rows(self, new: np.ndarray) -> None:
        """Append the rows whose bytes are `new` (no patch of rows on disk): the hot path of
        every flush. The bytes it fills were zeros, so only their sums after the copy are
        added to each chunk's checksum (less the one word an odd-sized record shares with
        the row before, counted already)."""
        k, isz, nbytes = self.chunk, self.dtype.itemsize, self._nbytes
        start = self.disk
        end = start + len(new) // isz
        imgs = [(c, *self._image(c)) for c in range(start // k, (end - 1) // k + 1)]
        self.ds.id.set_extent((end,))
        self.disk = end
        for c, raw, _, sums in imgs:
            lo, hi = max(start - c * k, 0) * isz, min(end - c * k, k) * isz
            if lo & 1:
                w = int(raw[lo - 1]) << 8
                sums[0] -= w
                sums[1] -= w * int(_weights((nbytes + 1) // 2)[lo // 2])
            at = c * k * isz - start * isz                  # chunk byte 0 in `new`
            raw[lo:hi] = new[at + lo:at + hi]
            s1, s2 = span_sums(raw, nbytes, lo, hi)
            sums[0] += s1
            sums[1] += s2
            self._write_chunk(c, raw, sums)

    def _write_chunk(self, c: int, raw: np.ndarray, sums: list[int]) -> None:
        # filter mask 0: the chunk went through the Fletcher-32 filter (stamp appends it)
        old = raw[-4:].copy() if faults.ARMED else None
        self.ds.id.write_direct_chunk((c * self.chunk,), stamp(raw, *sums), 0)
        if faults.ARMED:
            faults.hit("store_torn", partial(self._tear, c, raw, old))

    def _write_patched(self, patches: list, new: np.ndarray | None) -> None:
        """Patches of rows on disk (a full flush's status cache, a resume's `superseded`),
        with any new rows (their bytes)."""
        # the bytes of each chunk that patches and new rows change; the images (bytes, rows,
        # checksum sums) are held here: a long write may evict them from the cache
        k, isz = self.chunk, self.dtype.itemsize
        bounds = [(int(rows.min()), int(rows.max()) + 1) for rows, _ in patches]
        end = self.disk + (0 if new is None else len(new) // isz)
        spans = self._spans(bounds + ([(self.disk, end)] if end > self.disk else []))
        imgs = {c: self._image(c) for c in spans}
        before = {c: self._sums_before(imgs[c][0], c, *spans[c]) for c in spans}
        for (rows, fields), (r0, r1) in zip(patches, bounds):
            c_lo, c_hi = r0 // k, (r1 - 1) // k
            for c in range(c_lo, c_hi + 1):
                mine = slice(None) if c_lo == c_hi else (rows >= c * k) & (rows < (c + 1) * k)
                _set(imgs[c][1], rows[mine] - c * k, fields, mine)
        if new is not None:
            start = self.disk
            for c in range(start // k, -(-end // k)):
                lo, hi = max(c * k, start), min((c + 1) * k, end)
                imgs[c][0][(lo - c * k) * isz:(hi - c * k) * isz] = new[(lo - start) * isz:(hi - start) * isz]
            self.ds.id.set_extent((end,))
            self.disk = end
        for c in sorted(spans):
            # the sums updated by what changed instead of recomputed over the whole chunk
            raw, _, sums = imgs[c]
            (s1, s2), (b1, b2) = span_sums(raw, self._nbytes, *spans[c]), before[c]
            sums[0] += s1 - b1
            sums[1] += s2 - b2
            self._write_chunk(c, raw, sums)

    def _tear(self, c: int, raw: np.ndarray, old: np.ndarray) -> None:
        """Test-only (the store_torn fault): chunk c as a kill inside its rewrite leaves it,
        the new bytes with the old checksum (HDF5 rewrites a same-size chunk in place)."""
        torn = raw.copy()
        torn[-4:] = old
        self.ds.id.write_direct_chunk((c * self.chunk,), torn, 0)

    def boundary_crc(self, count: int) -> int:
        """prefix_crc of rows [c * chunk, count) of the chunk c holding row `count` (0 where
        count starts a chunk): what /commit_crc records with the count (docs/store.md).
        Extended by the rows committed since the last call (their masked bytes never change)."""
        have, crc = self._crc
        if have == count:
            return crc
        lo = count - count % self.chunk
        if have < lo and self.patched and (c := have // self.chunk) in self._img:
            # the chunk of `have` is full now: its crc extends the one kept (chunk_crc takes it)
            self._full_crc = (c, prefix_crc(self._img[c][1][have - c * self.chunk:], self.name, crc))
        if not lo <= have <= count:
            have, crc = lo, 0
        if have < count:
            img = self._image(count // self.chunk)[1]
            crc = prefix_crc(img[have - lo:count - lo], self.name, crc)
        self._crc = (count, crc)
        return crc

    def chunk_crc(self, c: int) -> int:
        """prefix_crc of the whole chunk c (written): what /chunk_crc records for it."""
        if self._full_crc[0] == c:
            return self._full_crc[1]
        return prefix_crc(self._image(c)[1], self.name)

    def mend(self, lo: int, hi: int) -> None:
        """Rewrite the chunk of rows [lo, hi) (a torn one that verify_path found, its committed
        rows verified): those rows as they are, zeros, a fresh Fletcher-32. A patched chunk's
        MUTABLE columns are then set again by the resume (replay_events, supersede)."""
        raw, _ = chunk_buffer(self.chunk, self.dtype)
        n = (hi - lo) * self.dtype.itemsize
        raw[:n] = np.frombuffer(self.ds.id.read_direct_chunk((lo,))[1], np.uint8, n)
        self.ds.id.write_direct_chunk((lo,), stamp(raw, *span_sums(raw, self._nbytes, 0, self._nbytes)), 0)
        self._img.pop(lo // self.chunk, None)

    def _sums_before(self, raw: np.ndarray, c: int, lo: int, hi: int) -> tuple[int, int]:
        """The sums of bytes [lo, hi) of chunk c before this write: only the words that
        reach a row already on disk hold anything (the rest of an image is zeros)."""
        used = max(0, min(self.chunk, self.disk - c * self.chunk)) * self.dtype.itemsize
        if lo // 2 * 2 >= used:                           # all in the zeros: new rows only
            return 0, 0
        return span_sums(raw, self._nbytes, lo, min(hi, used))

    def _spans(self, ranges: list[tuple[int, int]]) -> dict[int, tuple[int, int]]:
        """The byte range [lo, hi) within each chunk that the row ranges [r0, r1) cover."""
        isz, k = self.dtype.itemsize, self.chunk
        out: dict[int, tuple[int, int]] = {}
        for r0, r1 in ranges:
            for c in range(r0 // k, (r1 - 1) // k + 1):
                a, b = (max(r0, c * k) - c * k) * isz, (min(r1, (c + 1) * k) - c * k) * isz
                o = out.get(c)
                out[c] = (a, b) if o is None else (min(o[0], a), max(o[1], b))
        return out

    def _image(self, c: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """The image of chunk c (its bytes, its rows viewing them, the exact Fletcher sums of
        its bytes): kept, or read back (the rows of it on disk; zeros past them)."""
        if c in self._img:
            return self._img[c]
        raw, img = chunk_buffer(self.chunk, self.dtype)         # zeros + room for the checksum
        lo, sums = c * self.chunk, [0, 0]                       # zeros add nothing to the sums
        if lo < self.disk:
            used = min(self.chunk, self.disk - lo)
            self._read(lo, img[:used])
            sums = list(span_sums(raw, self._nbytes, 0, used * self.dtype.itemsize))
        self._img[c] = out = raw, img, sums
        while len(self._img) > self.IMAGES:                   # drop the oldest chunk's
            del self._img[min(self._img)]
        return out

    def _patch_new(self, new: np.ndarray, patches: list) -> list:
        """Apply the patches' updates of rows not yet on disk to `new`; return the updates
        of rows on disk, as patches of those rows only."""
        on_disk = []
        for rows, fields in patches:
            mine = rows >= self.disk
            if mine.any():
                _set(new, rows[mine] - self.disk, fields, mine)
            if not mine.all():
                if mine.any():
                    fields = {k: v[~mine] if np.ndim(v) else v for k, v in fields.items()}
                    rows = rows[~mine]
                on_disk.append((rows, fields))
        return on_disk

    def _read(self, lo: int, out: np.ndarray) -> None:
        """Read rows [lo, lo + len(out)) into `out` through the low-level API."""
        if not len(out):
            return
        fs = self.ds.id.get_space()
        fs.select_hyperslab((lo,), (len(out),))
        self.ds.id.read(h5py.h5s.create_simple((len(out),)), fs, out, mtype=self.ftype)

    def read(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Rows [lo, hi) as a record array (written ones only: call after a flush)."""
        hi = self.disk if hi is None else min(hi, self.disk)
        out = np.empty(max(hi - lo, 0), self.dtype)
        self._read(lo, out)
        return out


_TYPES: dict[np.dtype, h5py.h5t.TypeID] = {}


def _file_type(dtype: np.dtype) -> h5py.h5t.TypeID:
    """The HDF5 type of a table's records, made once per process (h5py builds and registers an
    object per compound field: ~40 us of a /samples table's create). HDF5 copies the type
    into the dataset it creates, so one transient type serves every file."""
    t = _TYPES.get(dtype)
    if t is None:
        t = _TYPES[dtype] = h5py.h5t.py_create(dtype, logical=True)
    return t


def _join(pieces: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """np.concatenate of record arrays of one dtype, as bytes (numpy's own concatenate
    resolves a compound dtype and copies field by field: ~20 us for 5 /events pieces)."""
    return np.concatenate([p.view(np.uint8) for p in pieces]).view(dtype)


def _set(dst: np.ndarray, idx, fields: dict, pick=slice(None)) -> None:
    """dst[name][idx] = each field's value: a scalar as it is, an array at `pick` (the
    positions of `idx` among the patch's rows)."""
    for name, v in fields.items():        # getattr, not np.ndim: ~0.6 us a field less
        dst[name][idx] = v[pick] if getattr(v, "ndim", 0) else v


class CrcLog:
    """/chunk_crc, appended as whole chunks (`H5Dwrite_chunk`, like the tables): HDF5's own
    write of a few records costs ~13 us in its conversion path, a direct write of the chunk
    ~2 us. The dataset has no filter, so the chunk's bytes are written as they are. The
    image of its last chunk is kept (read back on a resume)."""

    CHUNK = 512

    def __init__(self, ds: h5py.Dataset, fresh: bool = False):
        self.ds, self.n = ds, 0 if fresh else len(ds)
        if not fresh and (ds.dtype != CRC_DTYPE or ds.chunks != (self.CHUNK,) or
                          ds.id.get_create_plist().get_nfilters()):
            raise ValueError(f"{ds.file.filename}: /chunk_crc is not the unfiltered {CRC_DTYPE} log "
                             "this flexmarl_hpc writes (damaged file?)")
        self._c = self.n // self.CHUNK                    # the chunk the image holds
        self._img = np.zeros(self.CHUNK, CRC_DTYPE)
        if self.n % self.CHUNK:
            self._img[:self.n % self.CHUNK] = ds[self._c * self.CHUNK:self.n]

    def append(self, entries: list[tuple[int, int, int]]) -> None:
        """Append (table, chunk, crc) entries: one set_extent, one write per chunk touched."""
        new = np.array(entries, CRC_DTYPE)
        end = self.n + len(new)
        self.ds.id.set_extent((end,))
        pos = 0
        while pos < len(new):
            at = self.n % self.CHUNK
            k = min(self.CHUNK - at, len(new) - pos)
            self._img[at:at + k] = new[pos:pos + k]
            self.ds.id.write_direct_chunk((self._c * self.CHUNK,), self._img.view(np.uint8), 0)
            self.n, pos = self.n + k, pos + k
            if self.n % self.CHUNK == 0:                 # full: the next entry starts a chunk
                self._c, self._img = self._c + 1, np.zeros(self.CHUNK, CRC_DTYPE)

    def __getitem__(self, key) -> np.ndarray:
        return self.ds[key]


class StoreFile:
    """The run's HDF5 file: creates it, or re-opens it for a resume (repairing what an
    unclean exit left), buffers writes and commits them in `flush()`."""

    def __init__(self, path: Path, agents: list[str], attrs: dict, chunk: int = 1024):
        self.path = Path(path)
        self.agents = list(agents)
        fresh = not self.path.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.repaired: list[str] = []          # what re-opening fixed, for the log
        self.dirty: set[Table] = set()
        torn = verify_path(self.path) if not fresh else []    # before anything is used or changed
        if not fresh and clear_open_flags(self.path):
            self.repaired.append("cleared the open-for-write flags an unclean exit left")
        self.f = open_for_write(self.path)
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
        mk = partial(self._table, fresh)
        self.samples = {a: mk(f"samples/{a}", SAMPLE_COLUMNS, chunk, mirror=True) for a in self.agents}
        self.tokens = {a: mk(f"tokens/{a}", TOKEN_COLUMNS, 8 * chunk) for a in self.agents}
        self.steps = {a: mk(f"steps/{a}", STEP_COLUMNS, 256) for a in self.agents}
        self.step_rows = {a: mk(f"step_rows/{a}", None, 4096, "i8") for a in self.agents}
        self.intervals = mk("intervals", INTERVAL_COLUMNS, 4096)
        # small chunks: every flush rewrites the events table's last (dirty) chunk whole
        self.events = mk("events", EVENT_COLUMNS, 512)
        self.metrics = mk("metrics", METRIC_COLUMNS, 256)
        self.eval = mk("eval", EVAL_COLUMNS, 256)
        self.tools = mk("tools", TOOL_COLUMNS, 512)
        self.episodes = mk("episodes", episode_columns(len(self.agents)), 256)
        self.tables = {t.ds.name: t for t in self._all()}
        self._table_list = list(self.tables.values())
        self._due = False               # a light flush wrote rows other than /events, uncommitted
        self._crc_at = np.full(len(self.tables), -1, np.int64)     # the counts _crcs are for
        self._crcs = np.zeros(len(self.tables), np.int64)
        self.flushed = np.array([t.disk for t in self.tables.values()], np.int64)
        self._full_at = self.flushed.copy()          # rows whose full chunks /chunk_crc has
        self.failed: StoreError | None = None        # a write or flush of this file failed
        if fresh:
            self.commit = self._counts("commit")
            self.commit.attrs["tables"] = list(self.tables)
            self.commit_crc = self._counts("commit_crc")
            self.chunk_crc = self._chunk_log(fresh=True)
        else:
            self._recover(torn)
        self.f.swmr_mode = True

    def _table(self, fresh: bool, name: str, columns, chunk: int, dt=None, mirror: bool = False) -> Table:
        if not fresh and name in self.f:      # a new file has none: skip 13 group lookups
            return Table(self.f[name], columns, mirror, self.dirty)
        # the low-level create: h5py's create_dataset costs ~4x as much (~170 us a table)
        dtype = np.dtype(dt) if dt else dtype_of(columns)
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((chunk,))
        dcpl.set_fletcher32()           # every reader verifies a chunk it reads (docs/store.md)
        lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
        lcpl.set_create_intermediate_group(True)
        ds = h5py.h5d.create(self.f.id, name.encode(), _file_type(dtype),
                             h5py.h5s.create_simple((0,), (h5py.h5s.UNLIMITED,)), dcpl=dcpl, lcpl=lcpl)
        return Table(h5py.Dataset(ds), columns, mirror, self.dirty, created=(dtype, chunk))

    def _all(self) -> list[Table]:
        return [*self.samples.values(), *self.tokens.values(), *self.steps.values(),
                *self.step_rows.values(), self.intervals, self.events, self.metrics, self.eval,
                self.tools, self.episodes]

    def _recover(self, torn: list) -> None:
        """Cut every table back to its committed rows, mend the torn appends (boundary chunks
        a kill cut mid-write, their committed rows verified), then rebuild the status fields
        of the samples from the committed events."""
        self.commit = self.f["commit"]
        if "commit_crc" not in self.f:
            self.f.create_dataset("commit_crc", data=np.zeros(len(self.commit), np.int64))
        self.commit_crc = self.f["commit_crc"]
        self.chunk_crc = self._chunk_log()
        names = [str(n) for n in self.commit.attrs["tables"]]
        counts = dict(zip(names, self.commit[:].tolist()))
        if names != list(self.tables):
            self._add_to_commit(names, counts)
        # mended first: cutting the rows past a chunk's committed ones reads the chunk (HDF5
        # fills the cut part), and a torn chunk's checksum would fail that read
        for d in torn:
            self.tables[d.table].mend(d.lo, d.hi)
            self.repaired.append(f"rewrote the torn chunk of {d.table} rows {d.lo}-{d.hi - 1} (a kill "
                                 "cut its in-place write; its committed rows verified)")
        for name, t in self.tables.items():
            keep = counts.get(name)
            if keep is None or keep > len(t.ds):
                raise ValueError(f"{self.path}: /commit says {keep} rows of {name}, the file has "
                                 f"{len(t.ds)} (damaged file)")
            if len(t.ds) > keep:
                self.repaired.append(f"discarded {len(t.ds) - keep} uncommitted rows of {name}")
                t.ds.resize((keep,))
            t.disk = t.n = keep
        self._log_full_chunks()
        self.flushed = np.array([t.disk for t in self.tables.values()], np.int64)
        self._full_at = self.flushed.copy()
        for i, a in enumerate(self.agents):
            fixed = replay_events(self.samples[a], self.events.read(), i)
            if fixed:
                self.repaired.append(f"restored the status of {fixed} {a} samples from /events")
        self.flush()
        # /commit_crc anew at the counts kept: a kill inside the HDF5 flush that last wrote
        # /commit may have left it behind, and this run's first chunk write may be torn
        self._commit(self.flushed)
        self.f.flush()

    def _counts(self, name: str) -> h5py.Dataset:
        """A new /commit or /commit_crc: one i8 per table, zeros (the low-level create: h5py's
        create_dataset with data costs ~4x as much)."""
        n = len(self.tables)
        ds = h5py.h5d.create(self.f.id, name.encode(), h5py.h5t.STD_I64LE, h5py.h5s.create_simple((n,)))
        ds.write(h5py.h5s.ALL, h5py.h5s.ALL, np.zeros(n, np.int64), mtype=h5py.h5t.NATIVE_INT64)
        return h5py.Dataset(ds)

    def _chunk_log(self, fresh: bool = False) -> "CrcLog":
        """/chunk_crc: (table, chunk, crc) of each full committed chunk of a patched table."""
        if not fresh and "chunk_crc" in self.f:
            return CrcLog(self.f["chunk_crc"])
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((CrcLog.CHUNK,))
        ds = h5py.h5d.create(self.f.id, b"chunk_crc", _file_type(CRC_DTYPE),
                             h5py.h5s.create_simple((0,), (h5py.h5s.UNLIMITED,)), dcpl=dcpl)
        return CrcLog(h5py.Dataset(ds), fresh=True)

    def _log_full_chunks(self) -> None:
        """Add to /chunk_crc the full committed chunks of the patched tables it lacks (a kill
        inside the HDF5 flush that wrote /commit may have left it behind /commit)."""
        have = {(t, c) for t, c, _ in self.chunk_crc.ds[:].tolist()}
        new = [(i, c, t.chunk_crc(c)) for i, t in enumerate(self.tables.values()) if t.patched
               for c in range(t.disk // t.chunk) if (i, c) not in have]
        self._append_crcs(new)

    def _append_crcs(self, entries: list) -> None:
        if entries:
            self.chunk_crc.append(entries)

    def _add_to_commit(self, names: list[str], counts: dict) -> None:
        """A file written before a table was added (/eval): the new tables are empty, so
        /commit is rewritten with a 0 for each (it has a fixed length)."""
        new = [n for n in self.tables if n not in counts]
        if set(names) - set(self.tables) or any(len(self.tables[n].ds) for n in new):
            raise ValueError(f"{self.path}: /commit names tables {names}, this flexmarl_hpc has "
                             f"{list(self.tables)} (damaged file)")
        counts.update({n: 0 for n in new})
        del self.f["commit"], self.f["commit_crc"]
        self.commit = self.f.create_dataset("commit", data=np.array([counts[n] for n in self.tables]))
        self.commit.attrs["tables"] = list(self.tables)
        self.commit_crc = self.f.create_dataset("commit_crc", data=np.zeros(len(self.tables), np.int64))
        self.f.flush()
        self.repaired.append(f"added {', '.join(new)} to /commit")

    def append_eval(self, cols: dict) -> None:
        """Queue /eval rows (columns as lists); committed by the next flush."""
        self.eval.append(cols)

    def record_tool(self, now: float, agent: str | None, input_id: int, traj: int, call: int,
                    tool: str, outcome: str, latency_s: float) -> None:
        """Queue one /tools row (committed by the next flush): a tool call whose result feeds
        call `call` of `agent` in episode (input_id, traj), or a reward function's call
        (agent None: not tied to one; call -1). `outcome` is one of TOOL_OUTCOMES."""
        if outcome not in TOOL_OUTCOMES:
            raise ValueError(f"{self.path}: /tools outcome {outcome!r}: expected one of {', '.join(TOOL_OUTCOMES)}")
        row = np.zeros(1, self.tools.dtype)
        row[0] = (now, -1 if agent is None else self._agent_index(agent, "/tools agent"), input_id, traj,
                  call, _ascii(tool, 64, f"{self.path}: /tools tool"), TOOL_OUTCOMES.index(outcome), latency_s)
        self.tools.append(row)

    def record_episode(self, now: float, step: int, input_id: int, traj: int,
                       calls: dict[str, int], rewards: dict[str, float]) -> None:
        """Queue one /episodes row for an episode that finished (committed by the next flush,
        with its samples' rows: a kill never leaves half an episode counted). An agent missing
        from `calls` made none; one missing from `rewards` reads NaN."""
        row = np.zeros(1, self.episodes.dtype)
        row["step"], row["input_id"], row["traj"], row["t"], row["reward"] = step, input_id, traj, now, np.nan
        for field, values in (("calls", calls), ("reward", rewards)):
            for a, v in values.items():
                row[field][0, self._agent_index(a, f"/episodes {field}")] = v
        self.episodes.append(row)

    def _agent_index(self, agent: str, field: str) -> int:
        if agent not in self.agents:
            raise ValueError(f"{self.path}: {field} {agent!r}: expected one of the run's agents {self.agents}")
        return self.agents.index(agent)

    def now(self) -> float:
        return time.time() - self.t0

    def flush(self, full: bool = True) -> None:
        """Write every buffered row and patch, then commit: data first, then /commit, each
        made visible by an HDF5 flush, so a commit never names rows not yet written.

        `full=False` is the per-micro-batch flush (the orchestrator's hot path): every new
        row reaches the file (the CONSUMED events included) before it returns, but
          - /commit names the rows of the PREVIOUS flush, which that flush made durable, so
            one HDF5 flush suffices; rows of this one are committed by the next flush. A
            crash in between loses them exactly as if this flush had not happened: the
            micro-batch's trainer step was not committed either (on_stepped makes a full
            flush before a checkpoint can hold it), so the resume requeues its samples all
            the same;
          - it advances /commit only when those rows hold more than /events rows: status
            events alone (a micro-batch's CONSUMED) are worth no commit, since a resume
            requeues every micro-batch no checkpoint holds, committed or not, and rebuilds
            READY and DROPPED from the generated rows (docs/store.md, "Crash safety");
          - status patches of sample rows already on disk (the status fields are a cache of
            /events) wait for the next full one (each log line, checkpoint and close).
        """
        plan = self._plan(full)
        if plan is None or self.failed is not None:
            # after a failed write or flush, what HDF5 holds in memory is unknown: a later
            # flush that succeeds (a checkpoint's cleanup freed the disk) may leave out chunk
            # index entries the failed one lost, and a commit would then name rows no chunk
            # holds. Nothing more is committed; the resume starts from the last commit.
            return
        work, commit = plan
        try:
            for t in work:
                t.write(patch_disk=full or not t.mirror)
                if not t.patches:
                    self.dirty.discard(t)
                faults.hit("store_append")  # test-only: no-op unless FLEXMARL_FAULT is set
            counts = np.fromiter(map(attrgetter("disk"), self.tables.values()), np.int64, len(self.tables))
            if full:
                self.f.flush()
                faults.hit("store_flush")
            if commit:
                self._commit(counts if full else self.flushed)
            if not full:
                faults.hit("store_flush")
            self.f.flush()
            self.flushed = counts
            # rows other than /events that this light flush wrote: the next one commits them
            self._due = not full and any(t is not self.events for t in work)
        except (OSError, RuntimeError) as e:    # h5py raises either for a failed write/flush
            self.failed = StoreError.of(self.path, e)
            raise self.failed from None

    def _plan(self, full: bool) -> tuple[list, bool] | None:
        """(the tables to write, whether to commit) of a flush; None: it would change no byte
        of the file (nothing to write, and nothing /commit should name that it does not)."""
        if full:
            work = list(self.dirty)
            return (work, True) if work or not np.array_equal(self.flushed, self._crc_at) else None
        # a light flush leaves a status cache's patches of rows on disk queued, and status
        # events alone wait for the next write (docstring)
        work = [t for t in self.dirty if t.buf or not t.mirror]
        if all(t is self.events for t in work):
            work = []
        return (work, self._due) if work or self._due else None

    def _commit(self, counts: np.ndarray) -> None:
        """Write /commit_crc (the boundary chunks' prefix checksums at these counts), then
        /commit: both reach the file with the HDF5 flush that follows."""
        changed = np.flatnonzero(counts != self._crc_at)        # most flushes: a few tables
        if len(changed):
            tables, full = self._table_list, []
            for i in changed.tolist():
                t, k, was = tables[i], int(counts[i]), int(self._full_at[i])
                self._crcs[i] = t.boundary_crc(k)
                if t.patched and k // t.chunk > was // t.chunk:     # chunks this commit fills
                    full += [(i, c, t.chunk_crc(c)) for c in range(was // t.chunk, k // t.chunk)]
                    self._full_at[i] = k
            if full:
                self._append_crcs(full)
            self._crc_at = counts.copy()
            self.commit_crc.id.write(h5py.h5s.ALL, h5py.h5s.ALL, self._crcs, mtype=h5py.h5t.NATIVE_INT64)
        self.commit.id.write(h5py.h5s.ALL, h5py.h5s.ALL, counts, mtype=h5py.h5t.NATIVE_INT64)

    def samples_written(self) -> bool:
        """Whether an earlier process of this run left any sample rows."""
        return any(t.disk for t in self.samples.values())

    def supersede(self, versions: dict[str, int], first_logged: int) -> int:
        """Mark /steps rows whose version the trainers no longer have (a resume rolled
        them back) and /metrics rows of global steps >= first_logged as superseded; they
        are written again as the run redoes them. Returns how many rows it marked."""
        n = 0
        for a, t in self.steps.items():
            rows = t.read()
            old = np.nonzero((rows["version"] > versions[a]) & (rows["superseded"] == 0))[0]
            if len(old):
                t.patch(old, {"superseded": 1})
            n += len(old)
        rows = self.metrics.read()
        old = np.nonzero((rows["step"] >= first_logged) & (rows["superseded"] == 0))[0]
        if len(old):
            self.metrics.patch(old, {"superseded": 1})
        self.flush()
        return n + len(old)

    def close(self) -> None:
        if not self.f.id.valid:
            return
        self.flush()
        try:
            self.f.close()
        except (OSError, RuntimeError):
            if self.failed is None:                 # else reported already, by the failed flush
                raise


def replay_events(samples: Table, events: np.ndarray, agent_index: int) -> int:
    """Set the status fields of `samples` to what its committed events say (last event
    per row wins; reward/advantage/t_ready from the last READY event, trainer_step and
    t_consumed only while consumed). Returns how many rows changed."""
    ev = events[events["agent"] == agent_index]
    rows = samples.read()
    if not len(rows):
        return 0
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
    if len(idx):
        samples.patch(idx, {name: want[name][idx] for name in STATUS_FIELDS})
    return len(idx)


def _ascii(text: str, size: int, field: str) -> bytes:
    """`text` as the bytes of a fixed-length ascii column (numpy would cut a longer one)."""
    try:
        b = text.encode("ascii")
    except (UnicodeEncodeError, AttributeError):
        raise ValueError(f"{field} {text!r}: expected an ascii string") from None
    if not b or len(b) > size:
        raise ValueError(f"{field} {text!r}: expected 1 to {size} ascii characters")
    return b


def _last_per_row(rows: np.ndarray, n: int) -> np.ndarray:
    """Index of the last entry for each row 0..n-1 (-1 where none)."""
    last = np.full(n, -1, np.int64)
    last[rows] = np.arange(len(rows))           # numpy assigns in order: the last one wins
    return last


def check_file(f: h5py.File, path) -> None:
    """Refuse a file that is not ours or is of another schema version, saying which."""
    if f.attrs.get("program") != "flexmarl_hpc":
        raise ValueError(f"{path}: not a flexmarl_hpc run file (no program=flexmarl_hpc attribute)")
    v = int(f.attrs.get("schema_version", -1))
    if v != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema version {v}; this flexmarl_hpc writes version "
                         f"{SCHEMA_VERSION} (resume it with the release that wrote it)")
