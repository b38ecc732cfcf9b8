"""One table of the store, written as whole checksummed chunks (`Table`), and the
/chunk_crc log of the torn-write records (`CrcLog`): the chunk writing of `tables.StoreFile`.

Each table keeps images of its last chunks, puts new rows and patches into them and writes
each touched chunk directly (`H5Dwrite_chunk`) with the Fletcher-32 checksum HDF5's filter
expects (`store.checksum`); why, and what it costs: docs/store.md, "Checksums", and
docs/benchmarks.md.
"""
from __future__ import annotations

import zlib
from functools import partial

import h5py
import numpy as np

from flexmarl_hpc import faults
from flexmarl_hpc.store.checksum import (CRC_DTYPE, MUTABLE, _weights, chunk_buffer, has_checksums,
                                         prefix_crc, span_sums, stamp)
from flexmarl_hpc.store.schema import ADDED, DEFAULTS


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
            if not stored_as_written(ds):
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
        self._raw = (0, 0)                    # (count, crc32 of its boundary chunk's rows, every byte)
        self._touched: int | None = None      # the first row a patch rewrote since _raw was taken
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
        on_disk = rows.max() < self.disk      # most queued patches (a CONSUMED): one reduction
        if not on_disk and not self._queued_new and rows.min() >= self.disk:
            if len(self.buf) > 1:
                self.buf = [_join(self.buf, self.dtype)]
            _set(self.buf[0], rows - self.disk, fields)
            return
        # a scalar stays one (as _set and _patch_new treat it); lists become arrays
        fields = {k: v if isinstance(v, (np.ndarray, np.generic, int, float)) else np.asarray(v)
                  for k, v in fields.items()}
        if not on_disk:                       # it hits buffered rows: later patches must queue too
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
        first = min(r0 for r0, _ in bounds)
        self._touched = first if self._touched is None else min(self._touched, first)
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

    def boundary_raw(self, count: int) -> int:
        """zlib.crc32 of rows [c * chunk, count) of the chunk holding row `count`, every byte
        (patched columns included): what /count_crc records with the count. Extended by the
        rows committed since the last call, unless a patch rewrote rows it covers."""
        if not self.patched:
            return self.boundary_crc(count)          # no patched columns: the same bytes
        have, crc = self._raw
        lo = count - count % self.chunk
        if not lo <= have <= count or (self._touched is not None and self._touched < have):
            have, crc = lo, 0
        self._touched = None
        if have < count:
            crc = zlib.crc32(self._image(count // self.chunk)[1][have - lo:count - lo], crc)
        self._raw = (count, crc)
        return crc

    def patch_chunks(self) -> tuple[int, int] | None:
        """The chunk range [lo, hi) the queued patches of rows on disk rewrite in place (None:
        none): what /inflight declares before the write (docs/store.md)."""
        hit = [(int(r.min()), int(r.max())) for r, _ in self.patches if len(r) and r.min() < self.disk]
        if not hit:
            return None
        return min(a for a, _ in hit) // self.chunk, min(max(b for _, b in hit), self.disk - 1) // self.chunk + 1

    def chunk_crc(self, c: int) -> int:
        """prefix_crc of the whole chunk c (written): what /chunk_crc records for it."""
        if self._full_crc[0] == c:
            return self._full_crc[1]
        return prefix_crc(self._image(c)[1], self.name)

    def mend(self, lo: int, hi: int) -> None:
        """Rewrite the chunk of rows [lo, hi) (a torn one that verify_path found, its committed
        rows verified): those rows as they are, zeros, a fresh Fletcher-32. A patched chunk's
        MUTABLE columns are then set again by the resume (recovery.status_patch, supersede)."""
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


def stored_as_written(ds: h5py.Dataset) -> bool:
    """Whether a table is stored as this release writes it: packed records of its own dtype,
    Fletcher-32 the only filter (what a direct chunk write assumes)."""
    return ds.id.get_type() == h5py.h5t.py_create(ds.dtype) and has_checksums(ds) and \
        ds.id.get_create_plist().get_nfilters() == 1


_TYPES: dict[np.dtype, h5py.h5t.TypeID] = {}


def file_type(dtype: np.dtype) -> h5py.h5t.TypeID:
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


class Inflight:
    """/inflight: per table, the chunk range [lo, hi) of an in-place patch in flight, one
    unfiltered chunk written directly: one pwrite, in order before the patch's chunks (a
    kill inside them finds it), set back to zeros after the flush's commit."""

    def __init__(self, ds: h5py.Dataset, on: bool):
        self.ds, self.on = ds, on            # on: it names a patch now

    @classmethod
    def open(cls, f: h5py.File, tables: int) -> "Inflight":
        """The file's /inflight, or a new one (a fresh file, or one of an earlier release)."""
        if "inflight" in f and len(f["inflight"]) == 2 * tables:
            ds = f["inflight"]
            return cls(ds, bool(ds[:].any()))            # cleared once the repairs are written
        if "inflight" in f:
            del f["inflight"]
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((2 * tables,))
        ds = h5py.h5d.create(f.id, b"inflight", h5py.h5t.STD_I64LE, h5py.h5s.create_simple((2 * tables,)),
                             dcpl=dcpl)
        ds.write_direct_chunk((0,), np.zeros(2 * tables, "<i8").tobytes(), 0)     # allocated now
        return cls(h5py.Dataset(ds), False)

    def declare(self, spans: list[tuple[int, tuple[int, int]]]) -> None:
        """Name the chunks [lo, hi) of each table (its index) about to be patched; [] clears."""
        rec = np.zeros(len(self.ds), "<i8")
        for i, (lo, hi) in spans:
            rec[2 * i:2 * i + 2] = lo, hi
        self.ds.id.write_direct_chunk((0,), rec.tobytes(), 0)
        self.on = bool(spans)
