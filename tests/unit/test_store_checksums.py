"""Chunk checksums of the store (real HDF5 files): our Fletcher-32 is HDF5's, h5py verifies
the chunks we write directly, a damaged chunk is named in one line by every reader and
refused by a re-open that leaves the file as it was, a truncated file is refused, a store
written without checksums still reads with a notice, and salvage copies what verifies."""
import hashlib
import json
import os
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from flexmarl_hpc.analysis.load import AnalysisError, load_run
from flexmarl_hpc.store.checksum import (StoreDamaged, StoreUnreadable, damaged_chunks, fletcher32,
                                         verify_path, verify_store)
from flexmarl_hpc.store.tables import StoreError, StoreFile
from flexmarl_hpc.store.schema import GENERATED
from tests.conftest import ROOT
from tests.helpers import AGENTS, event_rows, in_child_then_kill, sample_rows, corrupt


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("n", [1, 2, 3, 359, 360, 361, 720, 721, 4097, 200001])
@pytest.mark.parametrize("fill", ["random", "zeros", "ones"])
def test_our_fletcher32_is_the_one_hdf5_stores(tmp_path, n, fill):
    data = {"random": np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8),
            "zeros": np.zeros(n, np.uint8), "ones": np.full(n, 255, np.uint8)}[fill]
    with h5py.File(tmp_path / "f.h5", "w") as f:
        ds = f.create_dataset("x", data=data, chunks=(n,), fletcher32=True)    # HDF5's own filter
        _, raw = ds.id.read_direct_chunk((0,))
    assert raw[:-4] == data.tobytes()
    assert fletcher32(raw[:-4]) == int.from_bytes(raw[-4:], "little")


def written(path, rows=300):
    s = StoreFile(path, AGENTS, {}, chunk=64)
    first = s.samples["a"].append(sample_rows(s, "a", rows))
    s.events.append(event_rows(s, "a", np.arange(first, first + rows), GENERATED))
    s.flush()
    return s


def test_h5py_verifies_the_chunks_we_write_and_refuses_a_corrupted_one(tmp_path):
    path = tmp_path / "s.h5"
    written(path).close()
    with h5py.File(path, "r") as f:
        assert len(f["samples/a"][:]) == 300 and not damaged_chunks(f)     # HDF5 checked every one
    offset = corrupt(path, "/samples/a", chunk=1)
    with h5py.File(path, "r") as f:
        f["samples/a"][:64]                                                  # chunk 0 still reads
        with pytest.raises(OSError, match="filter returned failure"):   # HDF5 2.0 words it so
            f["samples/a"][64:128]
        assert [(d.table, d.lo, d.hi, d.offset) for d in damaged_chunks(f)] == [("/samples/a", 64, 128, offset)]


@pytest.mark.parametrize("table", ["/samples/a", "/tokens/a", "/events"])
def test_a_damaged_store_is_refused_by_a_reopen_in_one_line_and_left_as_it_was(tmp_path, table):
    path = tmp_path / "s.h5"
    s = written(path)
    s.tokens["a"].append(np.zeros(3000, s.tokens["a"].dtype))
    s.flush()
    s.close()
    corrupt(path, table, chunk=0)
    before = sha(path)
    with pytest.raises(StoreDamaged) as e:
        StoreFile(path, AGENTS, {})
    msg = str(e.value)
    assert "\n" not in msg and f"checksum mismatch in {table} rows 0-" in msg and "file offset" in msg
    assert sha(path) == before
    with pytest.raises(AnalysisError, match=f"damaged store: checksum mismatch in {table}"):
        load_run(path)


def test_a_killed_writers_damaged_store_is_refused_without_clearing_its_flags(tmp_path):
    path = tmp_path / "s.h5"
    in_child_then_kill(lambda: written(path))
    corrupt(path, "/events", chunk=0)
    before = sha(path)
    with pytest.raises(StoreDamaged, match="/events"):
        StoreFile(path, AGENTS, {})
    assert sha(path) == before                                   # the flags are still set


def test_a_truncated_store_is_refused_and_left_as_it_was(tmp_path):
    path = tmp_path / "s.h5"
    written(path).close()
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 5000])
    before = sha(path)
    with pytest.raises(StoreUnreadable, match="truncated HDF5 file"):
        verify_path(path)
    with pytest.raises(StoreUnreadable, match="truncated"):
        StoreFile(path, AGENTS, {})
    assert sha(path) == before


def test_a_store_without_checksums_reads_with_a_one_line_notice(tmp_path):
    path = tmp_path / "old.h5"
    with h5py.File(path, "w", libver="latest") as f:         # what schema 2 wrote: no filter
        f.attrs.update(program="flexmarl_hpc", schema_version=2)
        f.create_dataset("events", data=np.zeros(5, "i8"), chunks=(4,), maxshape=(None,))
        c = f.create_dataset("commit", data=np.array([5]))
        c.attrs["tables"] = ["/events"]
    with h5py.File(path, "r") as f:
        notice = verify_store(f, path)
    assert "cannot be verified" in notice and "schema version 2" in notice and "\n" not in notice


def test_checksums_follow_random_appends_and_patches_of_odd_sized_rows(tmp_path):
    """The store updates a chunk's checksum from the bytes a write changes (store.checksum
    span_sums): after random appends, patches of old and new rows, light and full flushes
    and a re-open, every chunk still verifies (/events rows are 35 bytes: words straddle rows)."""
    path, rng = tmp_path / "s.h5", np.random.default_rng(3)
    s = StoreFile(path, AGENTS, {}, chunk=16)
    for i in range(60):
        if i == 30:
            s.close()
            s = StoreFile(path, AGENTS, {}, chunk=16)
        k = int(rng.integers(1, 40))
        ev = event_rows(s, "a", np.arange(k) + s.events.n, GENERATED)
        ev["t"] = rng.random(k)
        s.events.append(ev)
        # rows of full committed chunks and uncommitted rows: the committed rows of the last
        # chunk are fixed once written (/commit_crc holds their crc, checked on re-open)
        k = int(s.commit[list(s.tables).index("/events")])
        free = np.r_[0:k // s.events.chunk * s.events.chunk, k:s.events.n]
        if len(free) > 3:
            rows = rng.choice(free, size=min(5, len(free)), replace=False)
            s.events.patch(rows, {"t": rng.random(len(rows)), "status": int(rng.integers(0, 4))})
        s.flush(full=bool(i % 3 == 0))
    s.close()
    with h5py.File(path, "r") as f:
        assert not damaged_chunks(f) and len(f["events"][:]) == s.events.n


def test_plain_appends_of_odd_sized_rows_in_several_pieces_keep_every_checksum(tmp_path):
    """The append-only write (no patch of rows on disk: most flushes) adds only the sums of
    the bytes it fills, less the word a 35-byte /events row shares with the row before it;
    several pieces a flush, chunk boundaries crossed, a re-open in between: every chunk
    verifies and every row reads back. A step_rows append of int32 rows is converted."""
    path, rng = tmp_path / "s.h5", np.random.default_rng(5)
    s, want = StoreFile(path, AGENTS, {}, chunk=16), []
    for i in range(40):
        if i == 20:
            s.close()
            s = StoreFile(path, AGENTS, {}, chunk=16)
        for _ in range(int(rng.integers(1, 4))):
            k = int(rng.integers(1, 30))
            ev = event_rows(s, "a", np.arange(k) + s.events.n, GENERATED)
            ev["t"] = rng.random(k)
            s.events.append(ev)
            want.append(ev)
        s.flush(full=False)
    s.step_rows["a"].append(np.arange(5, dtype=np.int32))
    s.close()
    with h5py.File(path, "r") as f:
        assert not damaged_chunks(f)
        assert f["events"][:].tobytes() == np.concatenate(want).tobytes()
        assert f["step_rows/a"][:].tolist() == [0, 1, 2, 3, 4]


def test_each_full_chunk_of_a_patched_table_has_its_record(tmp_path):
    """/chunk_crc (written with the file's own compound type, no conversion) holds, for
    every chunk of /samples a commit filled, the crc32 of its rows without the status
    columns: what tells a torn in-place patch from damage."""
    from flexmarl_hpc.store.checksum import chunk_crcs, prefix_crc
    path = tmp_path / "s.h5"
    s = StoreFile(path, AGENTS, {}, chunk=16)
    for _ in range(5):
        s.samples["a"].append(sample_rows(s, "a", 13))
        s.flush()
    s.close()
    with h5py.File(path, "r") as f:
        rows, recs = f["samples/a"][:], chunk_crcs(f)["/samples/a"]
    assert sorted(recs) == [0, 1, 2, 3]
    assert all(recs[c] == prefix_crc(rows[16 * c:16 * c + 16], "/samples/a") for c in recs)


def test_the_chunk_log_spans_its_own_chunks_and_a_resume_appends_to_it(tmp_path):
    """/chunk_crc is written as whole chunks of 512 entries (store.chunked.CrcLog): past its
    first chunk, and after a re-open that reads its last, partly filled chunk back, every
    full chunk of /samples still has its record and the file verifies (HDF5 reads the log)."""
    from flexmarl_hpc.store.checksum import chunk_crcs, prefix_crc
    path = tmp_path / "s.h5"
    for rows in (700, 500):                   # 350 full chunks, then 250 more after a re-open
        s = StoreFile(path, AGENTS, {}, chunk=2)
        s.samples["a"].append(sample_rows(s, "a", rows))
        s.flush()
        s.close()
    assert not verify_path(path)
    with h5py.File(path, "r") as f:
        rows, recs = f["samples/a"][:], chunk_crcs(f)["/samples/a"]
        assert len(f["chunk_crc"]) == 600                                   # once each
    assert sorted(recs) == list(range(600))
    assert all(recs[c] == prefix_crc(rows[2 * c:2 * c + 2], "/samples/a") for c in recs)


def test_submit_refuses_a_damaged_store_before_sbatch_and_writes_nothing(tmp_path, monkeypatch):
    """Under Slurm the ranks start on compute nodes, so `submit` reads the store first (on
    the login node): a damaged one is refused before sbatch, the folder left as it was."""
    import flexmarl_hpc.submit as sub
    from flexmarl_hpc.config.schema import ConfigError
    path = tmp_path / "local.h5"
    written(path).close()
    corrupt(path, "/events", chunk=0)
    before = sha(path)
    monkeypatch.setattr(sub, "_slurm", lambda *a, **k: pytest.fail("sbatch was called"))
    with pytest.raises(ConfigError, match="cannot resume: .*checksum mismatch in /events"):
        sub.submit("configs/local.yaml", [f"run.output_dir={tmp_path}"], check_partitions=False)
    assert sha(path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["local.h5"]


def flush_on_a_full_disk(s, monkeypatch, **flush_kw) -> None:
    """One `s.flush(**flush_kw)` whose HDF5 flush fails with ENOSPC (StoreError), then the
    file's own flush back: there is room again."""
    def full(*a, **k):
        raise OSError(28, "No space left on device")
    real = s.f.flush
    monkeypatch.setattr(s.f, "flush", full)
    with pytest.raises(StoreError, match="no space left"):
        s.flush(**flush_kw)
    monkeypatch.setattr(s.f, "flush", real)

def test_after_a_failed_flush_nothing_more_is_committed(tmp_path, monkeypatch):
    """A flush that fails (a full disk) leaves HDF5's in-memory state unknown: a later flush
    that succeeds could commit rows whose chunk index entries the failed one lost (the
    disk-full e2e test met "checksum mismatch ... chunk at file offset -1" that way). /commit
    stays where the last good flush left it."""
    s = written(tmp_path / "s.h5")
    committed = s.commit[:].copy()
    first = s.samples["a"].append(sample_rows(s, "a", 50))
    s.events.append(event_rows(s, "a", np.arange(first, first + 50), GENERATED))

    flush_on_a_full_disk(s, monkeypatch)        # then room again (the checkpoint's cleanup)
    more = s.samples["a"].append(sample_rows(s, "a", 20))
    s.events.append(event_rows(s, "a", np.arange(more, more + 20), GENERATED))
    s.flush()
    s.close()
    with h5py.File(tmp_path / "s.h5", "r") as f:
        assert (f["commit"][:] == committed).all()


def test_a_failed_light_flush_after_one_that_wrote_rows_commits_nothing_new(tmp_path, monkeypatch):
    """A light (micro-batch) flush commits the rows of the flush before it. After a light
    flush wrote rows (due for the next commit), a light flush that fails, and every flush
    after it (room again, the close), commit nothing: /commit never counts rows the file may
    not hold (what HDF5 holds in memory after a failed flush is unknown)."""
    s = written(tmp_path / "s.h5")
    committed = s.commit[:].copy()
    first = s.samples["a"].append(sample_rows(s, "a", 50))
    s.events.append(event_rows(s, "a", np.arange(first, first + 50), GENERATED))
    s.flush(full=False)                          # written, committed by the next flush
    with h5py.File(tmp_path / "s.h5", "r", swmr=True) as f:
        assert len(f["samples/a"]) == 350 and (f["commit"][:] == committed).all()
    more = s.samples["a"].append(sample_rows(s, "a", 20))
    s.events.append(event_rows(s, "a", np.arange(more, more + 20), GENERATED))

    flush_on_a_full_disk(s, monkeypatch, full=False)   # then room again
    s.flush(full=False)
    s.flush()
    s.close()
    with h5py.File(tmp_path / "s.h5", "r") as f:
        assert (f["commit"][:] == committed).all()
        for name, k in zip(f["commit"].attrs["tables"], f["commit"][:]):
            assert k <= len(f[name]), name


def tear(path, table):
    """A kill inside the in-place rewrite of `table`'s last chunk: bytes past its committed
    rows changed, the old checksum (what the store_torn fault leaves)."""
    with h5py.File(path, "r", swmr=True) as f:
        k = dict(zip(f["commit"].attrs["tables"], f["commit"][:]))[table]
        step, isz = f[table].chunks[0], f[table].dtype.itemsize
        info = f[table].id.get_chunk_info_by_coord((k - k % step,))
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + k % step * isz)
        fh.write(np.random.default_rng(1).bytes(info.size - 4 - k % step * isz))


def test_salvage_keeps_a_torn_chunks_verified_rows_and_names_the_samples_it_cannot_keep(tmp_path):
    """A torn chunk's committed rows match their crc record: salvage keeps those of a table
    without patched columns (/events: no hole, so no sample lost) and names by id the
    samples of a torn /samples chunk (their status columns may hold a torn value)."""
    from flexmarl_hpc.store.salvage import salvage
    path = tmp_path / "s.h5"
    s = StoreFile(path, AGENTS, {}, chunk=64)
    rows = sample_rows(s, "a", 100)
    rows["input_id"] = np.arange(100)                  # a tree each: a lost sample takes no other
    s.samples["a"].append(rows)
    s.events.append(event_rows(s, "a", np.arange(100), GENERATED))
    s.close()
    tear(path, "/events")
    rep = salvage(path, tmp_path / "new.h5")
    assert [(d.table, d.torn) for d in rep.damage] == [("/events", True)] and "torn" in rep.lines()[0]
    assert rep.lost_rows["/events"] == 0 and rep.lost_ids == {"a": [], "b": []}
    with h5py.File(tmp_path / "new.h5", "r") as f:
        assert f["events"]["row"].tolist() == list(range(100)) and len(f["samples/a"]) == 100
    tear(path, "/samples/a")                           # rows 64-99
    rep = salvage(path, tmp_path / "new2.h5")
    assert rep.lost_ids["a"] == sorted(f"0_{i}" for i in range(64, 100)) and rep.unreadable["a"] == 0
    with h5py.File(tmp_path / "new2.h5", "r") as f:
        assert len(f["samples/a"]) == 64 and len(f["events"]) == 64


def many_flushes(path, flushes=30):
    """A store of 30 micro-batch flushes (3000 samples, 90000 tokens, ~1.5 MB): its chunk
    indexes and object headers spread through the file, so a cut loses some of each."""
    s = StoreFile(path, AGENTS, {}, chunk=64)
    for k in range(flushes):
        first = s.samples["a"].append(sample_rows(s, "a", 100, step=k))
        s.tokens["a"].append(np.zeros(3000, s.tokens["a"].dtype))
        s.events.append(event_rows(s, "a", np.arange(first, first + 100), GENERATED))
        s.flush()
    s.close()


@pytest.mark.parametrize("fraction", [0.5, 0.9])
def test_salvage_of_a_truncated_store_finishes_in_seconds_and_its_store_reopens(tmp_path, fraction):
    """An SWMR reader retried a metadata block cut off by the truncation with a doubling
    sleep (salvage ran 90-939 s with no output, issue 38): now it reads once, salvages what
    verifies (or refuses in one line), and the salvaged store passes a resume's checks."""
    path, out = tmp_path / "s.h5", tmp_path / "s.salvaged.h5"
    many_flushes(path)
    os.truncate(path, int(path.stat().st_size * fraction))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "flexmarl_hpc.analyze", "salvage", str(path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.monotonic() - t0
    print(f"salvage of a store cut at {fraction:.0%}: {wall:.2f} s, rc {p.returncode}")
    assert wall < 30, wall
    if p.returncode == 2:
        assert p.stderr.startswith("analyze salvage: ") and p.stderr.count("\n") == 1, p.stderr
        assert not out.exists()
        return
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"salvage: {path}: truncated HDF5 file"), p.stdout
    assert verify_path(out) == []
    load_run(out)
    s = StoreFile(out, AGENTS, {})                    # a resume's checks: verified, statuses replayed
    kept = s.samples["a"].n
    s.close()
    lost = json.loads(out.with_name(out.name + ".lost.json").read_text())
    assert kept + len(lost["lost_sample_ids"]["a"]) + lost["unreadable_sample_rows"]["a"] == 3000


def test_salvage_names_the_children_of_samples_in_a_damaged_chunk(tmp_path):
    """Agent b's samples answer agent a's (parent_id a's id, or "a/<id>" as an episode call
    names it). A damaged /samples/a chunk makes its rows unreadable, ids and trees unknown:
    their children are lost too and lost.json names each (it named none, and kept them)."""
    from flexmarl_hpc.store.salvage import salvage
    path = tmp_path / "s.h5"
    s = StoreFile(path, AGENTS, {}, chunk=64)
    for i, agent in enumerate(AGENTS):
        rows = sample_rows(s, agent, 200)
        rows["input_id"] = np.arange(200)           # a tree each: only a parent takes a child
        rows["sample_id"] = [f"{k}_{i}_0".encode() for k in range(200)]
        if agent == "b":
            rows["parent_id"] = [(f"a/{k}_0_0" if k % 2 else f"{k}_0_0").encode() for k in range(200)]
        s.samples[agent].append(rows)
        s.events.append(event_rows(s, agent, np.arange(200), GENERATED))
    s.close()
    corrupt(path, "/samples/a", chunk=1, nbytes=1024)          # rows 64-127
    rep = salvage(path, tmp_path / "new.h5")
    assert rep.unreadable["a"] == 64 and rep.lost_ids["a"] == []
    assert rep.lost_ids["b"] == sorted(f"{k}_1_0" for k in range(64, 128))
    lost = json.loads((tmp_path / "new.h5.lost.json").read_text())["lost_sample_ids"]
    assert lost["b"] == rep.lost_ids["b"]
    with h5py.File(tmp_path / "new.h5", "r") as f:
        assert len(f["samples/a"]) == 136 and len(f["samples/b"]) == 136


@pytest.mark.parametrize("table, lower", [("/events", 100), ("/samples/a", 100), ("/samples/a", 44),
                                          ("/tokens/a", 512), ("/tokens/a", 1024)],
                         ids=["events-in-a-chunk", "samples-past-a-full-chunk", "samples-to-a-chunk-start",
                              "tokens-by-a-whole-chunk", "tokens-to-zero"])
def test_a_lowered_commit_count_is_refused_and_the_file_left_as_it_was(tmp_path, table, lower):
    """Issue 38: /commit has no checksum of its own; a count lowered by damage made the resume
    cut committed rows (100 trained samples recorded as not consumed). The records written with
    each count disagree with it: /commit_crc (the crc of the boundary chunk's committed rows),
    /chunk_crc (a full chunk logged past the count) and /count_crc (the rows and the count
    itself: a table without patched columns lowered by whole chunks, 1024 -> 512 or 0 /tokens
    rows, has no row left in its boundary chunk to disagree). Refused before anything changes."""
    path = tmp_path / "s.h5"
    s = written(path)                                   # 300 rows, /samples chunks of 64
    s.tokens["a"].append(np.zeros(1024, s.tokens["a"].dtype))      # 2 chunks of 512
    s.close()
    with h5py.File(path, "r+") as f:
        i = [str(t) for t in f["commit"].attrs["tables"]].index(table)
        counts = f["commit"][:]
        n = int(counts[i])
        counts[i] -= lower
        f["commit"][:] = counts
    before = sha(path)
    with pytest.raises(StoreDamaged, match=f"/commit's count of {table} \\({n - lower} rows\\)"):
        StoreFile(path, AGENTS, {})
    assert sha(path) == before
    with pytest.raises(StoreDamaged):
        verify_path(path)
