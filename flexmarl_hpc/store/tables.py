"""The HDF5 store of a run: one writer (the orchestrator rank), SWMR readers.

    store = StoreFile(path, agents, attrs)    # created, or re-opened and repaired on resume
    store.samples[agent].append(rows)         # buffered
    store.flush(full=True)                    # written, committed, readable

The schema, the commit protocol and what a resume repairs are documented once, in
docs/store.md. The columns are in `store.schema`, the chunk writing of one table in
`store.table`. This module is the file: it creates the tables (one chunked 1-D dataset of a
compound dtype each, created up front so the file can switch to SWMR mode) and writes what
they buffer in `flush()`, the commit protocol: a light flush per micro-batch before the
trainer sees it, a full flush (every table, HDF5 flush, /commit, flush again) at every
optimizer step, checkpoint and log line. Re-opening cuts every table back to its committed
rows, rebuilds the status fields from the committed /events and clears a killed writer's
open-for-write flags (`store.repair`).
"""
from __future__ import annotations

from functools import partial
from operator import attrgetter
from pathlib import Path

import h5py
import numpy as np

from flexmarl_hpc.clock import REAL, Clock
from flexmarl_hpc import faults
from flexmarl_hpc.store import undo
from flexmarl_hpc.store.checksum import CRC_DTYPE, count_crc
from flexmarl_hpc.store.recovery import check_reopen
from flexmarl_hpc.store.repair import clear_open_flags
from flexmarl_hpc.store.chunked import CrcLog, Inflight, Table, file_type
from flexmarl_hpc.store.schema import EVAL_COLUMNS, EVENT_COLUMNS, FAILURE_COLUMNS, FAILURE_TEXT, INTERVAL_COLUMNS, METRIC_COLUMNS, SAMPLE_COLUMNS, SCHEMA_VERSION, STATUS_FIELDS, STEP_COLUMNS, TOKEN_COLUMNS, TOOL_COLUMNS, TOOL_OUTCOMES, check_file, dtype_of, episode_columns, table_names


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
        if getattr(e, "errno", None) == 122 or "errno = 122" in text or "quota exceeded" in text:
            err = cls(f"{path}: disk quota exceeded while writing the store; rows not yet "
                      "committed are discarded when the same command runs again")
            err.errno = 122             # EDQUOT: ranks/job.py's exit_code requeues it as ENOSPC
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
    end = REAL.monotonic() + wait_s          # another process's lock: real time, simulated run or not
    while True:
        try:
            return h5py.File(path, "a", libver="latest")
        except BlockingIOError:
            if REAL.monotonic() >= end:
                raise StoreError(f"{path}: another process has had the store open for {wait_s:g} s "
                                 "(its HDF5 file lock refuses this writer); close it (an h5py "
                                 "session reading it?) and run the same command again") from None
            REAL.sleep(0.05)


class StoreFile:
    """The run's HDF5 file: creates it, or re-opens it for a resume (repairing what an
    unclean exit left), buffers writes and commits them in `flush()`. `clock`: the run's
    (flexmarl_hpc.clock): its creation time, t0, and `now()`, the time every row is stamped with.
    `undoable`: a re-open keeps a copy for `revert()` (store/undo.py; episode workflows only)."""

    def __init__(self, path: Path, agents: list[str], attrs: dict, chunk: int = 1024, clock: Clock = REAL,
                 undoable: bool = False):
        self.path, self.clock = Path(path), clock
        self.agents = list(agents)
        fresh = not self.path.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.repaired: list[str] = []          # what re-opening fixed, for the log
        self.dirty: set[Table] = set()
        # every check first, reading only: a refused resume leaves the file as it was
        self.recovery = None if fresh else check_reopen(self.path, self.agents, table_names(self.agents))
        torn = [] if fresh else self.recovery.torn
        self._undo = undo.keep_copy(self.path, StoreError.of) if undoable and not fresh else None
        if not fresh and clear_open_flags(self.path):
            self.repaired.append("cleared the open-for-write flags an unclean exit left")
        self.f = open_for_write(self.path)
        if fresh:
            self.f.attrs.update({"schema_version": SCHEMA_VERSION, "program": "flexmarl_hpc",
                                 "created": clock.time(), "t0": clock.time(), "agents": self.agents,
                                 **attrs})
        else:
            check_file(self.f, self.path)           # checked by check_reopen; the file read again
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
        self.failures = mk("failures", FAILURE_COLUMNS, 64)
        self.tables = {t.ds.name: t for t in self._all()}
        assert list(self.tables) == table_names(self.agents)     # what check_reopen checks against
        self._table_list = list(self.tables.values())
        self._due = False               # a light flush wrote rows other than /events, uncommitted
        self._crc_at = np.full(len(self.tables), -1, np.int64)     # the counts _crcs are for
        self._crcs = np.zeros(len(self.tables), np.int64)
        self._raws = np.zeros(len(self.tables), np.int64)       # /count_crc at _crc_at
        self._committed = np.zeros(len(self.tables), np.int64)  # what /commit holds (a light flush's undo)
        self._index = {t: i for i, t in enumerate(self._table_list)}
        self._repatched: set[int] = set()       # tables whose committed rows a patch rewrote
        self.flushed = np.array([t.disk for t in self.tables.values()], np.int64)
        self._full_at = self.flushed.copy()          # rows whose full chunks /chunk_crc has
        self.failed: StoreError | None = None        # a write or flush of this file failed
        if fresh:
            self.commit = self._counts("commit")
            self.commit.attrs["tables"] = list(self.tables)
            self.commit_crc = self._counts("commit_crc")
            self.count_crc = self._counts("count_crc", count_crc(0, 0))      # the record of count 0
            self.inflight = Inflight.open(self.f, len(self.tables))
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
        ds = h5py.h5d.create(self.f.id, name.encode(), file_type(dtype),
                             h5py.h5s.create_simple((0,), (h5py.h5s.UNLIMITED,)), dcpl=dcpl, lcpl=lcpl)
        return Table(h5py.Dataset(ds), columns, mirror, self.dirty, created=(dtype, chunk))

    def _all(self) -> list[Table]:
        return [*self.samples.values(), *self.tokens.values(), *self.steps.values(),
                *self.step_rows.values(), self.intervals, self.events, self.metrics, self.eval,
                self.tools, self.episodes, self.failures]

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
        self._records_of_this_release()
        self._log_full_chunks()
        self.flushed = np.array([t.disk for t in self.tables.values()], np.int64)
        self._full_at = self.flushed.copy()
        # the statuses the committed events say, as check_reopen found them (the rows it read
        # are the ones kept: a mend rewrites committed bytes as they are, the cut only others)
        for a, (idx, want) in self.recovery.restatus.items():
            self.samples[a].patch(idx, {name: want[name] for name in STATUS_FIELDS})
            self.repaired.append(f"restored the status of {len(idx)} {a} samples from /events")
        self.flush()
        # /commit_crc anew at the counts kept: a kill inside the HDF5 flush that last wrote
        # /commit may have left it behind, and this run's first chunk write may be torn
        self._commit(self.flushed)
        self.f.flush()

    def _records_of_this_release(self) -> None:
        """/count_crc and /inflight, made for a file of an earlier release (its torn chunks
        were judged without them: verify_path found none or refused), /count_crc with the
        records of the counts kept (a kill before this re-open's commit finds them)."""
        n = len(self.commit)
        if "count_crc" not in self.f or len(self.f["count_crc"]) != n:
            if "count_crc" in self.f:
                del self.f["count_crc"]
            self.f.create_dataset("count_crc", data=np.array(
                [count_crc(t.boundary_raw(t.disk), t.disk) for t in self._table_list], np.int64))
        self.count_crc = self.f["count_crc"]
        self.inflight = Inflight.open(self.f, n)

    def _counts(self, name: str, fill: int = 0) -> h5py.Dataset:
        """A new /commit, /commit_crc or /count_crc: one i8 per table, `fill` (the low-level
        create: h5py's create_dataset with data costs ~4x as much)."""
        n = len(self.tables)
        ds = h5py.h5d.create(self.f.id, name.encode(), h5py.h5t.STD_I64LE, h5py.h5s.create_simple((n,)))
        ds.write(h5py.h5s.ALL, h5py.h5s.ALL, np.full(n, fill, np.int64), mtype=h5py.h5t.NATIVE_INT64)
        return h5py.Dataset(ds)

    def _chunk_log(self, fresh: bool = False) -> "CrcLog":
        """/chunk_crc: (table, chunk, crc) of each full committed chunk of a patched table."""
        if not fresh and "chunk_crc" in self.f:
            return CrcLog(self.f["chunk_crc"])
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((CrcLog.CHUNK,))
        ds = h5py.h5d.create(self.f.id, b"chunk_crc", file_type(CRC_DTYPE),
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

    def record_failure(self, now: float, step: int, input_id: int, traj: int, kind: str, message: str,
                       traceback: str) -> None:
        """Queue one /failures row: episode (input_id, traj) of `step` failed with an exception of
        type `kind` (committed by the next flush; text cut to FAILURE_TEXT's sizes)."""
        row = np.zeros(1, self.failures.dtype)
        row["t"], row["step"], row["input_id"], row["traj"] = now, step, input_id, traj
        for name, text in (("kind", kind), ("message", message), ("traceback", traceback)):
            row[name] = _fit(text, FAILURE_TEXT[name], keep_end=name == "traceback")
        self.failures.append(row)

    def _agent_index(self, agent: str, field: str) -> int:
        if agent not in self.agents:
            raise ValueError(f"{self.path}: {field} {agent!r}: expected one of the run's agents {self.agents}")
        return self.agents.index(agent)

    def now(self) -> float:
        return self.clock.time() - self.t0

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
        if not full and any(t.patches and not t.mirror for t in self.dirty):
            full = True         # its patches rewrite committed rows: /count_crc follows them
        plan = self._plan(full)
        if plan is None or self.failed is not None:
            # after a failed write or flush, what HDF5 holds in memory is unknown: a later
            # flush that succeeds (a checkpoint's cleanup freed the disk) may leave out chunk
            # index entries the failed one lost, and a commit would then name rows no chunk
            # holds. Nothing more is committed; the resume starts from the last commit.
            return
        work, commit = plan
        undo = None
        try:
            self._declare_patches(work, full)
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
                # a light flush writes /commit before its only HDF5 flush: kept to undo
                undo = None if full else (self._committed, self._crcs.copy(), self._raws.copy())
                self._commit(counts if full else self.flushed)
            if not full:
                faults.hit("store_flush")
            self.f.flush()
            if self.inflight.on:
                self.inflight.declare([])   # every chunk written and committed: nothing in flight
            self.flushed = counts
            # rows other than /events that this light flush wrote: the next one commits them
            self._due = not full and any(t is not self.events for t in work)
        except (OSError, RuntimeError) as e:    # h5py raises either for a failed write/flush
            self.failed = StoreError.of(self.path, e)
            if undo is not None:
                self._uncommit(*undo)
            raise self.failed from None

    def _declare_patches(self, work: list, full: bool) -> None:
        """The tear record: /inflight names the chunks this flush patches in place, one pwrite
        before their writes, so a kill inside them leaves it (docs/store.md, "Torn in-place
        writes"); their tables' /count_crc is then taken anew by the commit."""
        spans = [(self._index[t], span) for t in work if (full or not t.mirror)
                 and t.patches and (span := t.patch_chunks()) is not None]
        if spans or self.inflight.on:
            self.inflight.declare(spans)
            self._repatched.update(i for i, _ in spans)

    def _uncommit(self, counts: np.ndarray, crcs: np.ndarray, raws: np.ndarray) -> None:
        """After a light flush failed: put back in memory the /commit and its records it wrote
        before its failed HDF5 flush, or the close would write them (what the failed flush
        left in HDF5's memory is unknown: they may name rows no chunk holds)."""
        try:
            self.commit_crc.id.write(h5py.h5s.ALL, h5py.h5s.ALL, crcs, mtype=h5py.h5t.NATIVE_INT64)
            self.count_crc.id.write(h5py.h5s.ALL, h5py.h5s.ALL, raws, mtype=h5py.h5t.NATIVE_INT64)
            self.commit.id.write(h5py.h5s.ALL, h5py.h5s.ALL, counts, mtype=h5py.h5t.NATIVE_INT64)
        except (OSError, RuntimeError):
            pass                        # then the close fails too, and the file keeps its last commit

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
        if self._repatched:             # patched rows: /count_crc of their boundary chunk anew
            changed = np.union1d(changed, sorted(self._repatched))
            self._repatched.clear()
        if len(changed):
            tables, full = self._table_list, []
            for i in changed.tolist():
                t, k, was = tables[i], int(counts[i]), int(self._full_at[i])
                self._crcs[i] = t.boundary_crc(k)
                self._raws[i] = count_crc(t.boundary_raw(k), k)
                if t.patched and k // t.chunk > was // t.chunk:     # chunks this commit fills
                    full += [(i, c, t.chunk_crc(c)) for c in range(was // t.chunk, k // t.chunk)]
                    self._full_at[i] = k
            if full:
                self._append_crcs(full)
            self._crc_at = counts.copy()
            self.commit_crc.id.write(h5py.h5s.ALL, h5py.h5s.ALL, self._crcs, mtype=h5py.h5t.NATIVE_INT64)
            self.count_crc.id.write(h5py.h5s.ALL, h5py.h5s.ALL, self._raws, mtype=h5py.h5t.NATIVE_INT64)
        self.commit.id.write(h5py.h5s.ALL, h5py.h5s.ALL, counts, mtype=h5py.h5t.NATIVE_INT64)
        self._committed = counts

    def samples_written(self) -> bool:
        """Whether an earlier process of this run left any sample rows."""
        return any(t.disk for t in self.samples.values())

    def supersede(self, versions: dict[str, int], first_logged: int) -> int:
        """Derive every `superseded` flag of /steps and /metrics again (docs/store.md: each
        resume sets them; a flag is never taken from the file): a row is current iff it is
        the last row of its step and its step survives the resume (/steps: its version is
        one the trainers have; /metrics: its step < first_logged). Rows a resume rolled
        back are marked; a current row found marked (a flipped byte a torn-write repair
        kept) is set back. Returns how many rows it marked."""
        marked = 0
        for a, t in self.steps.items():
            rows = t.read()
            marked += self._derive(t, rows, rows["version"] <= versions[a], f"/steps/{a}")
        rows = self.metrics.read()
        marked += self._derive(self.metrics, rows, rows["step"] < first_logged, "/metrics")
        self.flush()
        return marked

    def _derive(self, t: Table, rows: np.ndarray, kept: np.ndarray, name: str) -> int:
        """Patch `superseded` of `rows` to: not (the last row of its step and `kept`)."""
        last = np.zeros(len(rows), bool)
        if len(rows):
            _, idx = np.unique(rows["step"][::-1], return_index=True)
            last[len(rows) - 1 - idx] = True
        want = (~(last & kept)).astype(rows.dtype["superseded"])
        diff = want != rows["superseded"]                   # any other byte value too
        on, off = np.nonzero(diff & (want == 1))[0], np.nonzero(diff & (want == 0))[0]
        for which, v in ((on, 1), (off, 0)):
            if len(which):
                t.patch(which, {"superseded": v})
        if len(off):
            self.repaired.append(f"cleared the superseded flag of {len(off)} current {name} rows")
        return len(on)

    def settle(self) -> None:  # the resume is reconciled: its repairs stand, the copy goes
        self._undo = undo.drop(self._undo)

    def revert(self) -> None:  # a refusal after the re-open's repairs: the file as it was
        self._undo = undo.put_back(self._undo, self.path, self.f)

    def close(self) -> None:
        if not self.f.id.valid:
            return
        self.settle()                   # a clean close: what this process wrote stands
        self.flush()
        try:
            self.f.close()
        except (OSError, RuntimeError):
            if self.failed is None:                 # else reported already, by the failed flush
                raise


def _ascii(text: str, size: int, field: str) -> bytes:
    """`text` as the bytes of a fixed-length ascii column (numpy would cut a longer one)."""
    try:
        b = text.encode("ascii")
    except (UnicodeEncodeError, AttributeError):
        raise ValueError(f"{field} {text!r}: expected an ascii string") from None
    if not b or len(b) > size:
        raise ValueError(f"{field} {text!r}: expected 1 to {size} ascii characters")
    return b


def _fit(text: str, size: int, keep_end: bool = False) -> bytes:
    """`text` as UTF-8 of at most `size` bytes: its start (or end), cut at a character."""
    b = str(text).encode("utf-8", "backslashreplace")
    if len(b) <= size:
        return b
    cut = b[len(b) - size:] if keep_end else b[:size]
    return cut.decode("utf-8", "ignore").encode("utf-8")
