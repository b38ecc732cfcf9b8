"""Chunk checksums of the store: HDF5's Fletcher-32 filter, computed here for direct writes.

    raw, rows = chunk_buffer(256, dtype)           # a chunk image with room for its checksum
    stamp(raw, *span_sums(raw, len(raw) - 4, 0, len(raw) - 4))   # its Fletcher-32, as HDF5 stores it
    bad = damaged_chunks(f)                        # every committed chunk verified: [Damage]
    verify_store(f, path)                          # raises StoreDamaged (one line) or returns a notice

Every table of a schema-3 store carries the Fletcher-32 filter, so every HDF5 reader (h5py
included) verifies a chunk when it reads it. The store writes whole chunks directly
(`write_direct_chunk`), which skips the filter pipeline: `stamp` appends the
checksum exactly as `H5_checksum_fletcher32` (src/H5checksum.c) computes it and
`H5Z_filter_fletcher32` stores it (UINT32ENCODE: little-endian). `damaged_chunks` reads each
committed chunk raw and checks it here, so a bad one is named by table, rows and file
offset instead of surfacing as an HDF5 error stack at whatever read touches it first.
docs/store.md says why the filter and what it cannot catch.
"""
from __future__ import annotations

import ctypes
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
from numpy.lib.recfunctions import repack_fields

from flexmarl_hpc.clock import REAL

FLETCHER32 = h5py.h5z.FILTER_FLETCHER32
SIGNATURE = b"\x89HDF\r\n\x1a\n"
_M = 65535


def fletcher32(data, length: int | None = None) -> int:
    """H5_checksum_fletcher32 of `data` (bytes or an array) followed by zeros up to `length`
    bytes (default: none), vectorised.

    HDF5 sums big-endian 16-bit words (an odd last byte is a word with a zero low byte),
    folding each sum ((s & 0xffff) + (s >> 16)) every 360 words and twice at the end. A
    fold keeps the value mod 65535 and never turns a positive sum into 0, so the result is
    the sum's residue mod 65535 in 1..65535 (0 only for a zero sum): computed here from the
    exact sums sum1 = sum(w_i) and sum2 = sum((n - i) * w_i) over the n words. Zero words
    add nothing to either, so a chunk's zero tail (the rows past its last one) is skipped."""
    b = data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    n = (max(len(b), length or 0) + 1) // 2
    odd = len(b) % 2                    # the last byte: the high byte of a word, low byte 0
    w = b[:len(b) - odd].view(">u2").astype(np.float64)
    weights = _weights(n)
    # float64 products summed by einsum (no BLAS threads) are exact: every partial sum of a
    # block stays below 2**53 (BLOCK words of at most 65535 x 65534 each)
    s1 = s2 = 0
    for lo in range(0, len(w), BLOCK):
        blk = w[lo:lo + BLOCK]
        s1 += int(blk.sum())
        s2 += int(np.einsum("i,i", blk, weights[lo:lo + len(blk)]))
    if odd:
        s1 += int(b[-1]) << 8
        s2 += (int(b[-1]) << 8) * int(weights[len(w)])
    nonzero = s1 > 0                    # then both sums are positive (every prefix after it)
    return (_fold(s2 % _M, nonzero) << 16) | _fold(s1 % _M, nonzero)


BLOCK = 1 << 20
_W: dict[int, np.ndarray] = {}


def _weights(n: int) -> np.ndarray:
    """(n - i) mod 65535 for word i of n, as float64 (cached: chunks have a few sizes)."""
    w = _W.get(n)
    if w is None:
        w = _W[n] = (np.arange(n, 0, -1, dtype=np.int64) % _M).astype(np.float64)
    return w


def _fold(residue: int, positive: bool) -> int:
    """The representative HDF5's folding ends with: 0 for a zero sum, else 1..65535."""
    return (residue or _M) if positive else 0


def chunk_buffer(rows: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """A chunk's bytes with room for its checksum, and its rows as a view of them: the
    direct write then sends the buffer as it is (no copy to append 4 bytes)."""
    raw = np.zeros(rows * dtype.itemsize + 4, np.uint8)
    return raw, raw[:-4].view(dtype)


def span_sums(raw: np.ndarray, nbytes: int, lo: int, hi: int) -> tuple[int, int]:
    """The exact (sum1, sum2) of fletcher32 over the 16-bit words of raw[:nbytes] that
    bytes [lo, hi) fall in, word i weighing (n - i). The sums are linear in the words, so a
    chunk's checksum follows a change of some of its bytes from the sums of those words
    before and after (and bytes appended over zeros add their own sums)."""
    n = (nbytes + 1) // 2
    wlo, whi = lo // 2, min((hi + 1) // 2, nbytes // 2)
    both = _both(n)                         # rows: 1, (n - i): both sums in one product
    s1 = s2 = 0
    for a in range(wlo, whi, BLOCK):
        w = raw[2 * a:2 * min(a + BLOCK, whi)].view(">u2").astype(np.float64)
        r = both[:, a:a + len(w)] @ w       # exact: see fletcher32
        s1, s2 = s1 + int(r[0]), s2 + int(r[1])
    if nbytes % 2 and hi >= nbytes:         # an odd last byte: the high byte of the last word
        s1 += int(raw[nbytes - 1]) << 8
        s2 += int(raw[nbytes - 1]) << 8     # the last word weighs 1
    return s1, s2


_BOTH: dict[int, np.ndarray] = {}


def _both(n: int) -> np.ndarray:
    """[[1] * n, (n - i) mod 65535]: the weights of sum1 and sum2 as one matrix (cached)."""
    m = _BOTH.get(n)
    if m is None:
        m = _BOTH[n] = np.stack([np.ones(n), _weights(n)])
    return m


def stamp(raw: np.ndarray, s1: int, s2: int) -> np.ndarray:
    """Write the Fletcher-32 of raw[:-4], whose exact sums are (s1, s2) (span_sums), into its
    last 4 bytes (little-endian, as H5Z_filter_fletcher32's UINT32ENCODE)."""
    nonzero = s1 > 0                        # exact sums: zero only for all-zero bytes
    value = (_fold(s2 % _M, nonzero) << 16) | _fold(s1 % _M, nonzero)
    raw.data[-4:] = value.to_bytes(4, "little")      # the buffer itself: no array made (~0.4 us)
    return raw


def has_checksums(ds: h5py.Dataset) -> bool:
    plist = ds.id.get_create_plist()
    return any(plist.get_filter(i)[0] == FLETCHER32 for i in range(plist.get_nfilters()))


@dataclass(frozen=True)
class Damage:
    """One chunk whose stored checksum does not match its bytes (or that cannot be read)."""
    table: str
    lo: int                   # its first row
    hi: int                   # one past its last committed row
    offset: int               # its byte offset in the file
    torn: bool = False        # a chunk a kill cut mid-rewrite, its committed rows verified (torn_chunk)

    why: str = ""             # not a chunk's checksum: what else disagrees (count_damage)
    chunk: int = -1           # its index, where only patched columns differ with no tear evidence

    def line(self) -> str:
        if self.why:
            return f"/commit's count of {self.table} ({self.hi} rows): {self.why}"
        where = f"{self.table} rows {self.lo}-{self.hi - 1} (chunk at file offset {self.offset})"
        if self.chunk >= 0:     # the fixed columns verify: say why it is not taken as a torn write
            where += (f": chunk {self.chunk}'s patched columns changed, and no in-place write of it "
                      "was in flight (no tear record in /inflight)")
        return where


class StoreInconsistent(ValueError):
    """Verified rows that cannot be replayed (a journalled sample without its parent's row,
    orchestrator/tree.py); the message is one line."""


class StoreDamaged(ValueError):
    """A store whose committed data fail their checksums; the message is one line."""

    def __init__(self, path, damage: list[Damage]):
        self.damage = damage
        more = f" and {len(damage) - 1} more chunk(s)" if len(damage) > 1 else ""
        super().__init__(f"{path}: damaged store: checksum mismatch in {damage[0].line()}{more}; "
                         "nothing was changed. `python -m flexmarl_hpc.analyze salvage "
                         f"{path}` copies every verifiable row into a new store (docs/store.md)")


# the columns a flush rewrites in rows already committed (in-place patches): status fields
# (a cache of /events, rebuilt by every resume) and `superseded` (set again by every resume);
# the prefix checksum leaves them out, so it is fixed once a row is committed
MUTABLE = {"/samples/": ("status", "reward", "advantage", "trainer_step", "t_ready", "t_consumed"),
           "/steps/": ("superseded",), "/metrics": ("superseded",)}


def prefix_crc(rows: np.ndarray, table: str, crc: int = 0) -> int:
    """zlib.crc32 of committed rows (a contiguous record array) with the bytes of the table's
    MUTABLE columns zeroed, continuing `crc` (the crc of the rows before them in the chunk)."""
    runs = _mutable_runs(rows.dtype, table)
    if not runs:
        return zlib.crc32(rows, crc)
    records = rows.view(np.uint8).reshape(len(rows), rows.dtype.itemsize).copy()
    for lo, hi in runs:                   # slices, not a fancy index: ~2 us for 64 rows, not 9
        records[:, lo:hi] = 0
    return zlib.crc32(records, crc)


_RUNS: dict = {}


def _mutable_runs(dtype: np.dtype, table: str) -> list[tuple[int, int]]:
    """The byte ranges within a record of its MUTABLE columns, adjacent ones merged."""
    key = (dtype, table.split("/")[1])
    if key not in _RUNS:
        mutable = next((m for p, m in MUTABLE.items() if table.startswith(p)), ())
        spans = sorted((dtype.fields[n][1], dtype.fields[n][1] + dtype[n].itemsize)
                       for n in mutable if dtype.names and n in dtype.names)
        runs: list[tuple[int, int]] = []
        for lo, hi in spans:
            if runs and runs[-1][1] == lo:
                runs[-1] = (runs[-1][0], hi)
            else:
                runs.append((lo, hi))
        _RUNS[key] = runs
    return _RUNS[key]


CRC_DTYPE = np.dtype([("table", "i2"), ("chunk", "i8"), ("crc", "i8")])


def count_crc(raw_crc: int, count: int) -> int:
    """The /count_crc record of a table: the crc32 of its boundary chunk's committed rows,
    every column (`raw_crc`), continued by the count itself (8 bytes, little-endian), so a
    count changed in the file fails it even where no row is left to check (a chunk start)."""
    return zlib.crc32(int(count).to_bytes(8, "little", signed=True), raw_crc)


@dataclass(frozen=True)
class Records:
    """What the writer recorded with each commit, to tell a torn write from damage and to
    check the counts (docs/store.md, "Torn in-place writes"): per table, /commit_crc (the
    boundary chunk's committed rows, patched columns left out), /count_crc (every column, and
    the count), /chunk_crc (full chunks of patched tables) and /inflight (the chunk range
    [lo, hi) of an in-place patch the writer began and did not finish). A record the file
    lacks (a store of an earlier release) is None or empty."""
    crc: dict[str, int]
    raw: dict[str, int]
    full: dict[str, dict[int, int]]
    inflight: dict[str, tuple[int, int]]

    def patching(self, table: str, c: int) -> bool:
        lo, hi = self.inflight.get(table, (0, 0))
        return lo <= c < hi


def records(f: h5py.File) -> Records:
    names = [str(n) for n in f["commit"].attrs["tables"]] if "commit" in f else []
    raw = dict(zip(names, f["count_crc"][:].tolist())) if "count_crc" in f and names else {}
    inflight = {}
    if "inflight" in f and names:
        spans = f["inflight"][:].reshape(-1, 2).tolist()
        inflight = {n: (lo, hi) for n, (lo, hi) in zip(names, spans) if hi > lo}
    return Records(prefix_crcs(f), raw, chunk_crcs(f), inflight)


def prefix_crcs(f: h5py.File) -> dict[str, int]:
    """The recorded prefix checksum of each table's boundary chunk (/commit_crc; {} without)."""
    if "commit_crc" not in f or "commit" not in f:
        return {}
    return {str(k): int(v) for k, v in zip(f["commit"].attrs["tables"], f["commit_crc"][:])}


def chunk_crcs(f: h5py.File) -> dict[str, dict[int, int]]:
    """The prefix_crc of each full committed chunk of the patched tables (/chunk_crc, a log:
    the last entry of a chunk counts), by table name and chunk index."""
    out: dict[str, dict[int, int]] = {}
    if "chunk_crc" not in f or "commit" not in f:
        return out
    names = [str(n) for n in f["commit"].attrs["tables"]]
    for t, c, crc in f["chunk_crc"][:].tolist():
        if 0 <= t < len(names):
            out.setdefault(names[t], {})[c] = crc
    return out


def read_rows(ds: h5py.Dataset, rows: int, torn: list[Damage] = (), fields: tuple[str, ...] = ()) -> np.ndarray:
    """ds[:rows], the rows of its torn chunks (verify_store's `torn`) from the chunks' raw
    bytes: HDF5 would refuse them (their Fletcher-32 no longer matches) and torn_chunk
    verified their committed rows. `fields`: only those columns, packed (HDF5 reads each
    chunk whole and keeps only them: the result holds no other column)."""
    sub = ds.fields(list(fields)) if fields else ds
    if not torn:
        return sub[:rows]
    parts, pos = [], 0
    for d in sorted(torn, key=lambda d: d.lo):
        raw = np.frombuffer(ds.id.read_direct_chunk((d.lo,))[1], ds.dtype, d.hi - d.lo)
        parts += [sub[pos:d.lo], repack_fields(raw[list(fields)]) if fields else raw]
        pos = d.hi
    return np.concatenate([*parts, sub[pos:rows]])


def committed(f: h5py.File) -> dict[str, int]:
    """Committed rows of each table (/commit), or the whole length where the file has none."""
    if "commit" in f:
        return {str(k): int(v) for k, v in zip(f["commit"].attrs["tables"], f["commit"][:])}
    out: dict[str, int] = {}
    f.visititems(lambda name, o: out.setdefault("/" + name, len(o))
                 if isinstance(o, h5py.Dataset) and o.chunks else None)
    return out


RETRIES = 2     # a live writer may be rewriting the chunk an SWMR reader reads: read it again


def chunk_damage(ds: h5py.Dataset, rows: int, fd: int, rec: Records | None = None,
                 retries: int = RETRIES) -> list[Damage]:
    """The chunks of ds's first `rows` rows that fail their Fletcher-32 (or are missing or
    of the wrong size). One pass over the chunk index (H5Dchunk_iter), then each chunk's
    bytes read from `fd` (the file, opened by the caller) and checked here: a per-chunk
    HDF5 look-up costs ~0.5 ms on a big file, this ~10 us plus the read. A chunk index
    that cannot be read (damaged or cut off: see open_bounded) makes every chunk damaged."""
    if not rows:
        return []
    step, bad, where = ds.chunks[0], [], {}
    try:
        ds.id.chunk_iter(lambda info: where.__setitem__(info.chunk_offset[0], info))
    except (OSError, RuntimeError, ValueError):
        where, retries = {}, 0
    size = step * ds.dtype.itemsize + 4
    for lo in range(0, rows, step):
        info = where.get(lo)
        for attempt in range(retries + 1):
            if _chunk_ok(info, size, fd):
                break
            if attempt < retries:
                REAL.sleep(0.05 * (attempt + 1))       # the writer may be rewriting it: look again
                info = _lookup(ds, lo)
        else:
            off = -1 if info is None or info.byte_offset is None else int(info.byte_offset)
            torn = torn_chunk(ds, info, lo // step, min(step, rows - lo), rows, fd, rec)
            bad.append(Damage(ds.name, lo, min(lo + step, rows), off, torn is True,
                              chunk=lo // step if torn == "unexplained" else -1))
    return bad


def torn_chunk(ds: h5py.Dataset, info, c: int, rows: int, count: int, fd: int, rec: Records | None):
    """Whether chunk c (`info`; its first `rows` rows committed, `count` rows in the table)
    failed its Fletcher-32 only because a kill cut an in-place rewrite of it, with evidence
    (docs/store.md, "Torn in-place writes"): True where every byte of its committed rows
    matches /count_crc (the boundary chunk: a torn append leaves them as they were), or where
    their fixed columns match their record (/commit_crc, /chunk_crc) and /inflight names
    the chunk (a patch of its patched columns was in flight); "unexplained" where only the
    fixed columns match (a patched column changed with no write in flight: damage); else False."""
    if rec is None or info is None or info.byte_offset is None or \
            info.size != ds.chunks[0] * ds.dtype.itemsize + 4:
        return False
    raw = os.pread(fd, rows * ds.dtype.itemsize, info.byte_offset)
    if len(raw) != rows * ds.dtype.itemsize:
        return False
    boundary = (c + 1) * ds.chunks[0] > count
    want = rec.crc.get(ds.name) if boundary else rec.full.get(ds.name, {}).get(c)
    if want is None or prefix_crc(np.frombuffer(raw, ds.dtype), ds.name) != want:
        return False
    patched = ds.name.startswith(tuple(MUTABLE))
    if not patched or rec.patching(ds.name, c):     # every byte checked, or a patch in flight
        return True
    if boundary and rec.raw.get(ds.name) == count_crc(zlib.crc32(raw), count):
        return True
    return "unexplained"


def _lookup(ds: h5py.Dataset, lo: int):
    try:
        return ds.id.get_chunk_info_by_coord((lo,))
    except (OSError, ValueError, RuntimeError, KeyError):
        return None


def _chunk_ok(info, size: int, fd: int) -> bool:
    """Whether the chunk `info` locates is whole and its stored Fletcher-32 matches."""
    if info is None or info.byte_offset is None or info.filter_mask != 0 or info.size != size:
        return False
    raw = os.pread(fd, size, info.byte_offset)
    return len(raw) == size and fletcher32(raw[:-4]) == int.from_bytes(raw[-4:], "little")


def count_damage(ds: h5py.Dataset, rows: int, fd: int, rec: Records) -> Damage | None:
    """/commit's count of `ds` against the records written with it: /commit_crc (the crc
    of the boundary chunk's first `rows % chunk` rows, 0 at a chunk start), /count_crc (the
    same rows, every column, and the count: it fails for a count moved by whole chunks too)
    and /chunk_crc (logged once a commit filled a chunk, so no entry lies past the count). A
    count changed in the file (lowered: the resume would cut committed rows) fails one of
    them; /commit has no checksum of its own. Only for a file no writer holds: a live writer
    updates them in one HDF5 flush, which an SWMR reader may see half done."""
    crc, full = rec.crc.get(ds.name), rec.full.get(ds.name)
    step, k = ds.chunks[0], rows % ds.chunks[0]
    past = [c for c in (full or {}) if (c + 1) * step > rows]
    if past:
        return Damage(ds.name, 0, rows, -1, why=f"/chunk_crc has chunk {max(past)} (rows up to "
                      f"{(max(past) + 1) * step - 1}) committed full")
    if crc is None:
        return None
    info = _lookup(ds, rows - k) if k else None
    raw_rows = os.pread(fd, k * ds.dtype.itemsize, info.byte_offset) if info is not None else b""
    whole = k and len(raw_rows) == k * ds.dtype.itemsize
    mine = prefix_crc(np.frombuffer(raw_rows, ds.dtype), ds.name) if whole else 0
    if (k and mine != crc) or (not k and crc != 0):
        return Damage(ds.name, 0, rows, -1, why="/commit_crc of its last chunk does not match the rows "
                      "it names (the count or its record changed)")
    raw = rec.raw.get(ds.name)
    if raw is not None and raw != count_crc(zlib.crc32(raw_rows), rows) and \
            not rec.patching(ds.name, rows // step):     # a patch in flight changed its rows
        return Damage(ds.name, 0, rows, -1, why="/count_crc does not match the count and the rows "
                      "it names (the count or its record changed)")
    return None


def damaged_chunks(f: h5py.File, only: tuple[str, ...] = ("/",), retries: int = RETRIES,
                   counts: bool = False) -> list[Damage]:
    """Every committed chunk of every checksummed table (whose name starts with one of
    `only`), verified; the bad ones. `retries`: look-ups again of a chunk that fails (0 for a
    file no writer holds: salvage). `counts`: /commit's counts checked too (count_damage;
    a file no writer holds)."""
    bad: list[Damage] = []
    rec = records(f)
    fd = os.open(f.filename, os.O_RDONLY)
    try:
        for name, rows in committed(f).items():
            ds = f.get(name) if name.startswith(only) else None
            if ds is None or not has_checksums(ds):
                continue
            mine = chunk_damage(ds, min(rows, len(ds)), fd, rec, retries)
            if counts and not mine and rows <= len(ds):
                mine = [d for d in [count_damage(ds, rows, fd, rec)] if d]
            bad += mine
    finally:
        os.close(fd)
    return bad


def verify_store(f: h5py.File, path, only: tuple[str, ...] = ("/",), torn: list | None = None,
                 counts: bool = False) -> str | None:
    """Raise StoreDamaged if a committed chunk (of the tables `only` names, by prefix) fails
    its checksum; return a one-line notice
    for a store written without checksums (schema <= 2), None for a verified one."""
    if not any(has_checksums(f[n]) for n in committed(f) if n in f):
        return (f"{path}: written without chunk checksums (schema version "
                f"{int(f.attrs.get('schema_version', 0))}); its data cannot be verified")
    found = damaged_chunks(f, only, counts=counts)
    bad = [d for d in found if not d.torn]
    if torn is not None:                # a torn append is no damage: the caller may mend it
        torn += [d for d in found if d.torn]
    if bad:
        raise StoreDamaged(path, bad)
    return None


class StoreUnreadable(ValueError):
    """A file that is not a whole HDF5 store (truncated, foreign); the message is one line."""


def check_not_truncated(path: Path) -> None:
    """Compare the file's size with the end-of-file address in its HDF5 superblock (v2/v3,
    what our writer makes): the check a plain open makes and an SWMR reader skips (which
    then retries metadata reads for a long time, or reads zeros, instead of failing)."""
    with open(path, "rb") as fh:
        head = fh.read(48)
    if head[:8] != SIGNATURE:
        return                          # not HDF5: the open says so
    if len(head) < 10:
        raise StoreUnreadable(f"{path}: truncated HDF5 file ({len(head)} bytes, cut inside the superblock)")
    if head[8] not in (2, 3):
        return                          # an old superblock: h5py will say
    size_of_offsets = head[9]
    end = 12 + 3 * size_of_offsets
    if size_of_offsets not in (2, 4, 8) or len(head) < end:
        raise StoreUnreadable(f"{path}: truncated or damaged HDF5 superblock ({len(head)} bytes read)")
    eof = int.from_bytes(head[12 + 2 * size_of_offsets:end], "little")
    actual = Path(path).stat().st_size
    if actual < eof:
        raise StoreUnreadable(f"{path}: truncated HDF5 file ({actual} bytes, the file says {eof})")


def open_read(path: Path) -> h5py.File:
    """The store opened read-only without changing it: after the size check, in SWMR mode
    (a killed writer's open-for-write flags keep a plain open out; clearing them would
    modify the file), or plainly for a file never switched to SWMR."""
    check_not_truncated(path)
    try:
        return h5py.File(path, "r", swmr=True)
    except OSError:
        try:
            return h5py.File(path, "r")
        except OSError as e:
            raise StoreUnreadable(f"{path}: not a readable HDF5 file "
                                  f"({' '.join(str(e).split())[:200]})") from None


def open_bounded(path: Path) -> h5py.File:
    """The file opened read-only and SWMR (so a killed writer's flags and a truncated end
    keep nothing out; the file is not changed) with ONE metadata read attempt: an SWMR
    reader retries a metadata block whose checksum fails with a doubling sleep up to 100
    times (H5C__load_entry: hours), which a block cut off by truncation or overwritten
    fails every time. For a file no writer holds (salvage): a live writer's half-written
    block then fails a read instead of being read again. h5py does not expose
    H5Pset_metadata_read_attempts; its extension module links libhdf5, so dlsym finds it."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    lib = ctypes.CDLL(h5py.h5f.__file__)
    if lib.H5Pset_metadata_read_attempts(ctypes.c_int64(fapl.id), ctypes.c_uint(1)) < 0:
        raise StoreUnreadable(f"{path}: cannot bound HDF5's metadata read attempts")
    try:
        fid = h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ, fapl=fapl)
    except (OSError, RuntimeError, ValueError) as e:
        raise StoreUnreadable(f"{path}: not a readable HDF5 file ({' '.join(str(e).split())[:200]})") from None
    return h5py.File(fid)


def verify_path(path: Path) -> list[Damage]:
    """verify_store of the file at `path`, opened by open_read; the file is not modified.
    Returns the torn boundary chunks (torn_append), which the writer's re-open mends."""
    with open_read(Path(path)) as f:
        if f.attrs.get("program") != "flexmarl_hpc":
            raise StoreUnreadable(f"{path}: not a flexmarl_hpc run file (no program=flexmarl_hpc attribute)")
        if verify_store(f, path, torn=(torn := []), counts=True) is not None:
            return []
        return torn
