"""End to end (issue 38): damage in the steps after the last checkpoint, salvage, move the
salvaged store into place, and the same command resumes like any resume. The kill is
staged without timing: a finished run whose newer checkpoints are removed is the state of
a run killed after the speaker's checkpoint of step 8 and before the listener's (speaker
at 8, listener at 4), so the listener redoes steps 4-7, which the speaker no longer can
sample, and steps 8-9 are redone by both. Checked by rules independent of the writer
(tests/helpers.py: the journal, every sample trained once) and against lost.json: a lost
sample either is gone (its step is one an agent's checkpoint is past: not sampled again)
or was sampled again with its id and trained once."""
import json
import shutil
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from tests.conftest import ROOT, run_training
from tests.helpers import SMALL, check_exactly_once, check_journal

# the damaged original stays beside the salvaged store; the resumed store is checked by the
# journal rule in the test itself (check_journal)
pytestmark = pytest.mark.damages_store("the damaged original is kept beside the salvaged store")
STEPS, CKPT = 10, 4
ARGS = [*SMALL, f"run.steps={STEPS}", f"run.checkpoint_every={CKPT}", "store.chunk_rows=32", "run.eval_every=0"]
VERSIONS = {"speaker": 8, "listener": 4}          # restored versions: the kill between the two


@pytest.fixture(scope="module")
def finished(tmp_path_factory, mpiexec):
    out = tmp_path_factory.mktemp("finished")
    run_training(out, *ARGS)
    return out


def killed_between_checkpoints(run):
    """Keep each agent's checkpoints up to VERSIONS: what a kill after the speaker's
    checkpoint of step 8 and before the listener's leaves (loading trusts the manifests)."""
    for agent, keep in VERSIONS.items():
        folder = run / "checkpoints" / agent
        for m in folder.glob("v*.manifest.json"):
            if json.loads(m.read_text())["version"] > keep:
                (folder / json.loads(m.read_text())["entry"]).unlink()
                m.unlink()
        (folder / "latest").write_text(f"v{keep:06d}.pt")


def damage(path, table, chunk):
    """Random bytes over the middle half of one chunk's committed rows."""
    with h5py.File(path, "r") as f:
        ds = f[table]
        counts = dict(zip(f["commit"].attrs["tables"], f["commit"][:]))
        info = ds.id.get_chunk_info_by_coord((chunk * ds.chunks[0],))
        rows = min(ds.chunks[0], int(counts[table]) - chunk * ds.chunks[0])
        used = rows * ds.dtype.itemsize
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + used // 4)
        fh.write(np.random.default_rng(chunk).bytes(used // 2))


def ids_steps(path):
    with h5py.File(path, "r") as f:
        return {a: dict(zip((x.decode() for x in f[f"samples/{a}"]["sample_id"][:]), f[f"samples/{a}"]["step"][:]))
                for a in VERSIONS}


def salvage_and_resume(tmp_path, finished, damaged, unnamed=()):
    """`unnamed`: (agent, rows) lost in a damaged /samples chunk, their ids with it."""
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
    path = tmp_path / "local.h5"
    killed_between_checkpoints(tmp_path)
    before = ids_steps(path)
    with h5py.File(path, "r") as f:
        hidden = {a: {x.decode() for x in f[f"samples/{a}"]["sample_id"][rows]} for a, rows in unnamed}
    for table, chunk in damaged:
        damage(path, table, chunk)
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "flexmarl_hpc.analyze", "salvage", str(path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    t_salvage = time.time() - t0
    assert p.returncode == 0, p.stderr
    lost = json.loads((tmp_path / "local.salvaged.h5.lost.json").read_text())["lost_sample_ids"]
    path.rename(tmp_path / "local.damaged.h5")
    (tmp_path / "local.salvaged.h5").rename(path)
    t0 = time.time()
    q = run_training(tmp_path, *ARGS, timeout=120, check=False)   # the same command
    t_resume = time.time() - t0
    print(f"salvage {t_salvage:.1f} s, resume {t_resume:.1f} s")
    assert q.returncode == 0, (q.stdout[-3000:], q.stderr[-3000:])
    assert f"resumed at versions {VERSIONS}" in q.stdout, q.stdout
    assert not (tmp_path / "local.h5.undo").exists()        # no copy: only an episode replay can refuse after the repairs
    check_journal(path)
    check_exactly_once(path, STEPS)
    after = ids_steps(path)
    ahead = max(VERSIONS.values())
    for agent, ids in lost.items():
        ids = set(ids) | hidden.get(agent, set())
        assert ids, agent
        for i in ids:            # gone where no version can sample it again, else sampled again
            assert (i in after[agent]) == (before[agent][i] >= ahead), (agent, i, before[agent][i])
        assert set(after[agent]) == set(before[agent]) - {i for i in ids if before[agent][i] < ahead}
    return q, lost, before


def test_samples_damaged_after_the_last_checkpoint_salvage_then_resume(finished, tmp_path):
    # speaker rows 96-127 (steps 6-7: the listener redoes them without those trees) and
    # 128-159 (steps 8-9: sampled again by both)
    q, lost, before = salvage_and_resume(tmp_path, finished, [("/samples/speaker", 3), ("/samples/speaker", 4)],
                                         unnamed=[("speaker", slice(96, 160))])
    assert "step 6: inputs" in q.stdout and "trained without them" in q.stdout, q.stdout
    assert {before["listener"][i] for i in lost["listener"]} == {6, 7, 8, 9}


def test_events_damaged_after_the_last_checkpoint_salvage_then_resume(finished, tmp_path):
    q, lost, before = salvage_and_resume(tmp_path, finished, [("/events", 2)])
    assert min(before["speaker"][i] for i in lost["speaker"]) >= CKPT, lost      # after the checkpoint
    assert "trained without them" in q.stdout, q.stdout
