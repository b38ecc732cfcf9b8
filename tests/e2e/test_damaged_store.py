"""End to end: a real finished run's store, damaged (4 kB of random bytes in one chunk of
each table) or truncated, is refused before launch (rc 2, one line naming the table, the
file's bytes unchanged) and by analyze; salvage copies what verifies, and a resume from the
salvaged store trains every sample once or reports it lost by id."""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from tests.conftest import ROOT, run_training
from tests.helpers import check_exactly_once

pytestmark = pytest.mark.damages_store("each test damages, truncates or forges a copy of a finished store")
STEPS = 20
TABLES = ["/samples/speaker", "/tokens/listener", "/steps/speaker", "/step_rows/listener", "/intervals",
          "/events", "/metrics", "/eval"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, mpiexec):
    out = tmp_path_factory.mktemp("finished")
    run_training(out, f"run.steps={STEPS}")
    return out


def copy(run, tmp):
    shutil.copytree(run, tmp, dirs_exist_ok=True)
    return tmp / "local.h5"


def damage(path, table, chunk=0, nbytes=4096):
    """Overwrite nbytes (at most the chunk's committed rows) in the middle of the committed
    rows of one chunk of `table` (bytes past them belong to no committed row: a torn append
    may change them, and the resume mends such a chunk, see the torn tests below)."""
    with h5py.File(path, "r") as f:
        info = f[table].id.get_chunk_info(chunk)
        counts = dict(zip(f["commit"].attrs["tables"], f["commit"][:]))
        ds = f[table]
        rows = min(ds.chunks[0], int(counts[table]) - info.chunk_offset[0])
        used = rows * ds.dtype.itemsize
    n = min(nbytes, used)
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + (used - n) // 2)
        fh.write(np.random.default_rng(7).bytes(n))


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def analyze(*args):
    return subprocess.run([sys.executable, "-m", "flexmarl_hpc.analyze", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


def refused_before_launch(tmp, what):
    p = run_training(tmp, f"run.steps={STEPS}", check=False)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.startswith("config error: run.output_dir: cannot resume") and p.stderr.count("\n") == 1, p.stderr
    assert what in p.stderr and "launching" not in p.stdout and "Traceback" not in p.stderr


@pytest.mark.parametrize("table", TABLES)
def test_a_damaged_chunk_is_refused_by_resume_and_analyze_naming_its_table(finished, tmp_path, table):
    path = copy(finished, tmp_path)
    damage(path, table)
    before = sha(path)
    refused_before_launch(tmp_path, f"checksum mismatch in {table} rows 0-")
    assert sha(path) == before                      # nothing rebuilt, flags not cleared
    p = analyze(path, "--no-plots")
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"analyze: {path}: damaged store: checksum mismatch in {table}"), p.stderr


def test_a_truncated_store_is_refused_before_launch_and_left_as_it_was(finished, tmp_path):
    path = copy(finished, tmp_path)
    os.truncate(path, path.stat().st_size - 100_000)
    before = sha(path)
    refused_before_launch(tmp_path, "truncated HDF5 file")
    assert sha(path) == before


def test_salvage_then_resume_trains_every_sample_once_or_reports_it_lost(finished, tmp_path):
    path = copy(finished, tmp_path)
    damage(path, "/events", chunk=2)
    damage(path, "/tokens/listener", chunk=1)
    before = sha(path)
    p = analyze("salvage", path)
    assert p.returncode == 0, p.stderr
    assert "/events rows 1024-1535" in p.stdout and "/tokens/listener rows" in p.stdout, p.stdout
    assert sha(path) == before
    salvaged = path.with_suffix(".salvaged.h5")
    lost = json.loads((tmp_path / "local.salvaged.h5.lost.json").read_text())["lost_sample_ids"]
    assert lost["speaker"] and lost["listener"]
    with h5py.File(path, "r") as f:
        old = {a: {x.decode() for x in f[f"samples/{a}"]["sample_id"][:]} for a in lost}
    path.rename(tmp_path / "local.damaged.h5")      # docs/store.md: the salvaged store in its place
    salvaged.rename(path)
    run_training(tmp_path, f"run.steps={STEPS + 4}")
    check_exactly_once(path, STEPS + 4)             # every sample left in the store: trained once
    with h5py.File(path, "r") as f:
        for a, ids in lost.items():
            new = {x.decode() for x in f[f"samples/{a}"]["sample_id"][:]}
            assert old[a] - new == set(ids) and not new & set(ids)     # the rest: reported lost
    assert analyze(path, "--no-plots").returncode == 0


def boundary(path):
    """A table whose last committed chunk is partly filled: (table, committed rows in that
    chunk, rows per chunk, itemsize, the chunk's file offset and size)."""
    with h5py.File(path, "r") as f:
        counts = dict(zip(f["commit"].attrs["tables"], f["commit"][:]))
        for t in ("/events", "/tokens/speaker", "/samples/speaker", "/intervals"):
            k, step = int(counts[t]), f[t].chunks[0]
            if k % step:
                info = f[t].id.get_chunk_info_by_coord((k - k % step,))
                return t, k % step, step, f[t].dtype.itemsize, info.byte_offset, info.size
    raise AssertionError("no partly filled last chunk")


def test_a_torn_last_chunk_resumes_and_damage_in_its_committed_rows_is_refused(finished, tmp_path):
    """A kill inside a rewrite of a table's last chunk (HDF5 rewrites it in place) leaves
    bytes past the committed rows changed and the old checksum: the resume mends it (the
    committed rows match /commit_crc); the same bytes in the committed rows are refused."""
    for where in ("tail", "checksum", "committed"):
        run = tmp_path / where
        path = copy(finished, run)
        table, rows, step, isz, off, size = boundary(path)
        rng = np.random.default_rng(3)
        with open(path, "r+b") as fh:
            if where == "tail":             # garbage in the uncommitted rows
                fh.seek(off + rows * isz)
                fh.write(rng.bytes(size - 4 - rows * isz))
            elif where == "checksum":       # the new rows' bytes, the old checksum
                fh.seek(off + size - 4)
                fh.write(b"\x01\x02\x03\x04")
            else:                           # the same damage inside a committed row
                fh.seek(off + (rows - 1) * isz)
                fh.write(rng.bytes(isz))
        if where == "committed":
            h = sha(path)
            refused_before_launch(run, table)
            assert sha(path) == h
            continue
        h = sha(path)
        a = analyze(path, "--no-plots")     # read-only: the committed rows, the file unchanged
        assert a.returncode == 0 and sha(path) == h, (where, a.stderr)
        p = run_training(run, f"run.steps={STEPS}", check=False)
        assert p.returncode == 0, (where, p.stdout[-2000:], p.stderr[-2000:])
        assert f"rewrote the torn chunk of {table}" in p.stdout, p.stdout
        check_exactly_once(path, STEPS)
        assert analyze(path, "--no-plots").returncode == 0


def test_a_torn_status_patch_of_a_full_chunk_resumes_and_damage_in_its_other_columns_is_refused(finished, tmp_path):
    """A full flush rewrites a full, committed /samples chunk in place to patch status
    fields, after naming the chunk in /inflight: a kill inside that write leaves those fields
    torn and the record. Its other columns match /chunk_crc, so the resume mends it and
    replays the statuses from /events; the same status bytes with no record (issue 38: they
    were taken as a tear by default), or damage in a column written once (sample_id), are
    refused."""
    for column, record in (("status", True), ("status", False), ("sample_id", True)):
        run = tmp_path / f"{column}-{record}"
        path = copy(finished, run)
        with h5py.File(path, "r") as f:
            ds = f["samples/speaker"]
            assert dict(zip(f["commit"].attrs["tables"], f["commit"][:]))["/samples/speaker"] > ds.chunks[0]
            info = ds.id.get_chunk_info_by_coord((0,))
            at = info.byte_offset + 3 * ds.dtype.itemsize + ds.dtype.fields[column][1]
            width = ds.dtype[column].itemsize
        with open(path, "r+b") as fh:                   # row 3 of chunk 0
            fh.seek(at)
            fh.write(bytes([0x5a] * width))
        if record:                                      # what the flush wrote before the chunk
            with h5py.File(path, "r+") as f:
                i = [str(t) for t in f["commit"].attrs["tables"]].index("/samples/speaker")
                f["inflight"][2 * i:2 * i + 2] = [0, 1]
        if column == "sample_id" or not record:
            h = sha(path)
            refused_before_launch(run, "/samples/speaker rows 0-")
            assert sha(path) == h
            continue
        assert analyze(path, "--no-plots").returncode == 0
        p = run_training(run, f"run.steps={STEPS}", check=False)
        assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
        assert "rewrote the torn chunk of /samples/speaker rows 0-" in p.stdout, p.stdout
        assert "restored the status of" in p.stdout, p.stdout
        check_exactly_once(path, STEPS)
