"""The HDF5 journal on its own (real HDF5 files, real SIGKILLs): re-opening after an unclean
exit, torn appends, superseded rows, and readers of schema versions 1 and 2."""
import hashlib
import os
import signal

import h5py
import numpy as np
import pytest

from flexmarl_hpc.analysis.load import load_run
from flexmarl_hpc.store.checksum import StoreDamaged, verify_path
from flexmarl_hpc.store.repair import clear_open_flags, lookup3
from flexmarl_hpc.store.tables import StoreFile
from flexmarl_hpc.store.chunked import Table
from flexmarl_hpc.store.schema import CONSUMED, GENERATED, READY
from tests.helpers import AGENTS, event_rows, in_child_then_kill, sample_rows


def test_lookup3_matches_known_vectors():
    # Bob Jenkins' published hashlittle values
    assert lookup3(b"", 0) == 0xDEADBEEF
    assert lookup3(b"Four score and seven years ago", 0) == 0x17770551
    assert lookup3(b"Four score and seven years ago", 1) == 0xCD628161


def test_a_killed_writer_leaves_a_file_that_reopens(tmp_path):
    path = tmp_path / "s.h5"

    def write():
        s = StoreFile(path, AGENTS, {})
        first = s.samples["a"].append(sample_rows(s, "a", 5))
        s.events.append(event_rows(s, "a", np.arange(first, first + 5), GENERATED))
        s.flush()
        return s

    in_child_then_kill(write)
    with pytest.raises(OSError, match="already open for write"):
        h5py.File(path, "a")                                   # what a plain re-open meets
    s = StoreFile(path, AGENTS, {})                            # ours clears the flags
    assert any("open-for-write flags" in r for r in s.repaired)
    assert len(s.samples["a"].read()) == 5
    s.close()
    assert not clear_open_flags(path)                          # a clean close leaves none


def test_a_torn_append_is_discarded_and_statuses_follow_the_events(tmp_path):
    path = tmp_path / "s.h5"

    def write():
        s = StoreFile(path, AGENTS, {})
        s.samples["a"].append(sample_rows(s, "a", 4))
        s.events.append(event_rows(s, "a", np.arange(4), GENERATED))
        s.samples["a"].patch([0, 1], {"status": READY, "reward": 1.0})
        s.events.append(event_rows(s, "a", [0, 1], READY, reward=1.0))
        s.flush()                                              # committed: 4 rows, 6 events
        # killed mid-append: rows and a status change reach the file, the commit does not
        s.samples["a"].append(sample_rows(s, "a", 3, step=1))
        s.samples["a"].patch([0, 1], {"status": CONSUMED, "trainer_step": 0})
        s.events.append(np.zeros(5, s.events.dtype))           # zero-filled, as after ENOSPC
        # the flush's own protocol (/inflight declared, chunks written, HDF5 flush), killed
        # just before it commits
        s._commit = lambda counts: os.kill(os.getpid(), signal.SIGKILL)
        s.flush()

    in_child_then_kill(write)
    with h5py.File(path, "r", swmr=True) as f:                 # the torn rows are in the file
        assert len(f["samples/a"]) == 7 and len(f["events"]) == 11
        assert f["samples/a"]["status"][:2].tolist() == [CONSUMED] * 2
    s = StoreFile(path, AGENTS, {})
    rows, ev = s.samples["a"].read(), s.events.read()
    assert len(rows) == 4 and len(ev) == 6                     # back to the commit
    assert rows["status"].tolist() == [READY, READY, GENERATED, GENERATED]
    assert rows["trainer_step"].tolist() == [-1] * 4 and rows["reward"][:2].tolist() == [1.0, 1.0]
    assert (ev["t"] >= 0).all() and not (ev == np.zeros(1, ev.dtype)).any()
    assert len(s.repaired) >= 2
    s.close()
    with h5py.File(path, "r", swmr=True) as f:                 # a plain SWMR reader agrees
        assert f["samples/a"]["status"].tolist() == [READY, READY, GENERATED, GENERATED]


def test_whole_chunk_writes_keep_every_row_across_chunks_reopens_and_old_patches(tmp_path, monkeypatch):
    """Rows reach the file as whole chunks built in memory: an append that crosses chunks,
    a re-open whose first append lands in a chunk already half on disk, patches of chunks
    no longer kept in memory or spread over several, and patches of rows not yet written
    (applied in order) must all leave every other row as it was."""
    monkeypatch.setattr(Table, "IMAGES", 2)
    path = tmp_path / "s.h5"
    s = StoreFile(path, AGENTS, {}, chunk=4)
    want = sample_rows(s, "a", 3)
    s.samples["a"].append(want)
    s.flush()
    s.close()
    s = StoreFile(path, AGENTS, {}, chunk=4)                   # rows 0-2 of chunk 0 on disk
    more = sample_rows(s, "a", 19, step=1)
    s.samples["a"].append(more[:6])                            # rows 3-8: chunks 0, 1, 2
    s.flush(full=False)
    s.samples["a"].append(more[6:])                            # rows 9-21: chunk 0 dropped
    s.samples["a"].patch([1, 20], {"status": CONSUMED, "trainer_step": [7, 8]})
    s.samples["a"].patch([20], {"trainer_step": 9})                     # after it, not before
    s.flush()
    s.samples["a"].patch([13, 6, 9], {"reward": [0.5, 0.25, 1.0]})     # chunks 3, 1, 2: on disk
    s.samples["a"].patch([], {"status": CONSUMED})             # no rows: nothing to do
    s.flush()
    want = np.concatenate([want, more])
    want["status"][[1, 20]], want["trainer_step"][[1, 20]] = CONSUMED, [7, 9]
    want["reward"][[13, 6, 9]] = [0.5, 0.25, 1.0]
    with h5py.File(path, "r", swmr=True) as f:                 # a plain SWMR reader agrees
        assert f["samples/a"][:].tobytes() == want.tobytes()
    assert s.samples["a"].read().tobytes() == want.tobytes()
    s.close()


def test_a_file_with_other_chunks_resumes_with_its_own(tmp_path):
    """A run resumed into a file written with another store.chunk_rows (1024 rows before
    256 became the default) writes whole chunks of the file's size, not the config's."""
    path = tmp_path / "s.h5"
    s = StoreFile(path, AGENTS, {}, chunk=16)
    want = sample_rows(s, "a", 11)
    s.samples["a"].append(want)
    s.close()
    s = StoreFile(path, AGENTS, {}, chunk=4)
    assert s.samples["a"].chunk == 16
    more = sample_rows(s, "a", 11, step=1)
    s.samples["a"].append(more)
    s.samples["a"].patch([3, 20], {"status": CONSUMED})
    s.close()
    want = np.concatenate([want, more])
    want["status"][[3, 20]] = CONSUMED
    with h5py.File(path, "r", swmr=True) as f:
        assert f["samples/a"].chunks == (16,) and f["samples/a"][:].tobytes() == want.tobytes()


def test_a_micro_batch_flush_writes_generated_rows_and_the_next_commits_them(tmp_path):
    """flush(full=False) writes new rows other than /events at once (readable) and commits
    them with the next light flush; status events alone (a micro-batch's CONSUMED) wait for
    the next write, since no resume needs them (docs/store.md, "Crash safety")."""
    path, seen = tmp_path / "s.h5", {}

    def look(name):                           # what a SWMR reader sees now
        with h5py.File(path, "r", swmr=True) as f:
            seen[name] = (len(f["samples/a"]), len(f["events"]), f["commit"][:].tolist())

    def write():
        s = StoreFile(path, AGENTS, {})
        s.samples["a"].append(sample_rows(s, "a", 4))
        s.events.append(event_rows(s, "a", np.arange(4), GENERATED))
        s.flush()                                              # full: 4 rows, 4 events
        s.samples["a"].patch([0, 1], {"status": CONSUMED, "trainer_step": 0})
        s.events.append(event_rows(s, "a", [0, 1], CONSUMED, tstep=0))
        s.flush(full=False)                                    # micro-batch 1: events only
        look("mb1")
        first = s.samples["a"].append(sample_rows(s, "a", 2, step=1))
        s.events.append(event_rows(s, "a", [first, first + 1], GENERATED))
        s.flush(full=False)                                    # a generation's rows
        look("gen")
        s.samples["a"].patch([2], {"status": CONSUMED, "trainer_step": 0})
        s.events.append(event_rows(s, "a", [2], CONSUMED, tstep=0))
        s.flush(full=False)                                    # micro-batch 2: commits them
        look("mb2")
        (tmp_path / "seen").write_text(repr(seen))
        return s

    in_child_then_kill(write)
    seen = eval((tmp_path / "seen").read_text())
    counts = {"mb1": (4, 4), "gen": (6, 8), "mb2": (6, 8)}    # (samples, events) in the file
    assert {k: v[:2] for k, v in seen.items()} == counts
    commit = {k: v[2] for k, v in seen.items()}
    assert commit["mb1"] == commit["gen"] != commit["mb2"]     # only mb2 commits (the generation)
    s = StoreFile(path, AGENTS, {})
    rows, ev = s.samples["a"].read(), s.events.read()
    assert len(rows) == 6 and len(ev) == 8                     # micro-batch 2's event was not written
    assert rows["status"].tolist() == [CONSUMED, CONSUMED] + [GENERATED] * 4
    assert rows["trainer_step"].tolist() == [0, 0, -1, -1, -1, -1]     # rebuilt from the events
    s.samples["a"].patch([2], {"status": READY})
    s.events.append(event_rows(s, "a", [2], READY))
    s.flush(full=False)
    s.flush()                                                  # a full flush writes the cache
    with h5py.File(path, "r", swmr=True) as f:
        assert f["samples/a"]["status"].tolist() == [CONSUMED, CONSUMED, READY] + [GENERATED] * 3
        assert f["commit"][:].tolist() == s.flushed.tolist()
    s.close()


def test_superseded_rows_are_marked_and_readers_count_current_ones(tmp_path):
    path = tmp_path / "s.h5"
    s = StoreFile(path, AGENTS, {})
    for a in AGENTS:
        for step in range(3):
            s.steps[a].append({"step": [step], "version": [step + 1], "t_end": [0.0], "n_samples": [1],
                               "n_micro": [1], "loss": [0], "reward_mean": [step], "entropy": [0],
                               "kl": [0], "grad_norm": [0], "staleness_max": [0], "staleness_mean": [0],
                               "rows_offset": [0], "rows_len": [0]})
    for step in range(3):
        s.metrics.append({c: [step] for c in ("step", "t", "wall", "samples", "tokens", "samples_per_s",
                                                "rollout_s", "train_s", "sync_s", "swap_s", "utilization",
                                                "staleness_max")})
    s.flush()
    # the trainers came back at version 1 (a) and 2 (b): global step 1 onwards is redone
    assert s.supersede({"a": 1, "b": 2}, first_logged=1) == 2 + 1 + 2
    s.steps["a"].append({"step": [1], "version": [2], "t_end": [0.0], "n_samples": [1], "n_micro": [1],
                         "loss": [0], "reward_mean": [10], "entropy": [0], "kl": [0], "grad_norm": [0],
                         "staleness_max": [0], "staleness_mean": [0], "rows_offset": [0], "rows_len": [0]})
    s.close()
    with h5py.File(path, "r") as f:
        assert f["steps/a"]["superseded"].tolist() == [0, 1, 1, 0]
        assert f["steps/b"]["superseded"].tolist() == [0, 0, 1]
        assert f["metrics"]["superseded"].tolist() == [0, 1, 1]
    run = load_run(path)
    a = run.steps[run.steps.agent == "a"]
    assert a.step.tolist() == [0, 1] and a.reward_mean.tolist() == [0, 10]
    assert run.metrics.step.tolist() == [0]


def test_schema_1_files_are_still_read(tmp_path):
    """A version-1 file (one dataset per column, duplicate step rows after a resume): the
    reader gets the same frames, keeping the last row of a step."""
    from flexmarl_hpc.analysis.load import V1_ONLY
    from flexmarl_hpc.store.schema import EVENT_COLUMNS, INTERVAL_COLUMNS, METRIC_COLUMNS, SAMPLE_COLUMNS, STEP_COLUMNS
    path = tmp_path / "v1.h5"
    with h5py.File(path, "w") as f:
        f.attrs.update(schema_version=1, program="flexmarl_hpc", agents=["a"], t0=0.0, config_yaml="")
        tables = {"samples/a": (SAMPLE_COLUMNS, 2), "steps/a": (STEP_COLUMNS, 3),
                  "intervals": (INTERVAL_COLUMNS, 1), "events": (EVENT_COLUMNS, 2),
                  "metrics": (METRIC_COLUMNS, 3)}
        for name, (cols, n) in tables.items():
            for c, dt in cols.items():
                if c in V1_ONLY.get(name.split("/")[0], cols):
                    f[f"{name}/{c}"] = np.zeros(n, dt)
        f["steps/a/step"][:] = [0, 1, 1]
        f["steps/a/reward_mean"][:] = [0.5, 0.1, 0.9]
        f["metrics/step"][:] = [0, 1, 1]
        f["samples/a/status"][:] = CONSUMED
    run = load_run(path)
    assert run.steps.step.tolist() == [0, 1] and run.steps.reward_mean.tolist() == pytest.approx([0.5, 0.9])
    assert run.metrics.step.tolist() == [0, 1] and len(run.samples) == 2
    assert "superseded" not in run.steps and "reward" not in run.events
    assert run.samples["retokenized"].tolist() == [0, 0] and run.samples["prefill_len"].tolist() == [0, 0]


def test_journal_rows_tokens_and_status_changes_read_back_as_the_readme_says(tmp_path):
    from flexmarl_hpc.orchestrator.experience import Journal
    from flexmarl_hpc.orchestrator.tree import Node
    s = StoreFile(tmp_path / "s.h5", AGENTS, {})
    j = Journal(s)
    nodes = [Node("b", 1, 0, 7, t, None, [], None, prompt=[1, 2, 3], response=[4 + t] * (t + 1),
                  logprobs=[-0.5 - t] * (t + 1), version=0, replica=1) for t in range(3)]
    j.generated(nodes, now=1.0)
    s.flush()
    for n, r in zip(nodes, (0.0, 1.0, 0.5)):
        n.reward, n.advantage = r, r - 0.5
    j.status(nodes, READY, now=2.0)
    j.status(nodes[:2], CONSUMED, now=3.0, trainer_step=0)
    s.close()
    with h5py.File(tmp_path / "s.h5", "r", swmr=True) as f:
        for i, n in enumerate(nodes):                       # the README's recipe
            r = f["samples/b"][i]
            seq = f["tokens/b"][r["token_offset"]:r["token_offset"] + r["prompt_len"] + r["response_len"]]
            assert seq["token"][:r["prompt_len"]].tolist() == n.prompt
            assert seq["token"][r["prompt_len"]:].tolist() == n.response
            assert seq["logprob"][r["prompt_len"]:].tolist() == n.logprobs
            assert np.isnan(seq["logprob"][:r["prompt_len"]]).all()
            assert r["sample_id"].decode() == f"7_1_{i}" and r["reward"] == n.reward
        rows = f["samples/b"][:]
        assert rows["status"].tolist() == [CONSUMED, CONSUMED, READY]
        assert rows["trainer_step"].tolist() == [0, 0, -1] and rows["t_consumed"][0] == 3.0
        ev = f["events"][:]
        assert ev["status"].tolist() == [GENERATED] * 3 + [READY] * 3 + [CONSUMED] * 2
        assert ev["advantage"][3:6].tolist() == [-0.5, 0.5, 0.0] and (ev["agent"] == 1).all()


def test_a_batchs_version_and_replica_are_written_as_given_else_read_from_each_node(tmp_path):
    """Journal.changes takes a generation batch's version and replica as one value each (no
    pass over the nodes for them); without them each node's own are written."""
    from flexmarl_hpc.orchestrator.experience import Journal
    from flexmarl_hpc.orchestrator.tree import Changes, Node
    s = StoreFile(tmp_path / "s.h5", AGENTS, {})
    j = Journal(s)
    nodes = [Node("a", 0, 0, 3, t, None, [], None, prompt=[1], response=[2], logprobs=[-0.1],
                  version=t, replica=10 + t) for t in range(3)]
    j.changes(Changes(generated=nodes[:2]), 1.0, version=5, replica=2)
    j.changes(Changes(generated=nodes[2:]), 1.0)
    s.close()
    with h5py.File(tmp_path / "s.h5", "r", swmr=True) as f:
        rows = f["samples/a"][:]
        assert rows["policy_version"].tolist() == [5, 5, 2] and rows["replica"].tolist() == [2, 2, 12]
        assert [n.row for n in nodes] == [0, 1, 2]


def test_parent_ids_of_roots_children_mixed_batches_and_episode_calls():
    """The journal's parent_id column: a parent's sample_id, "" for a root, an episode
    call's parent_call first, whatever mix a batch holds."""
    from flexmarl_hpc.orchestrator.experience import _parent_ids
    from flexmarl_hpc.orchestrator.tree import Node
    root = Node("a", 0, 0, 3, 1, None, [], None)
    kids = [Node("b", 1, 0, 3, t, root, [], None) for t in range(2)]
    call = Node("b", 0, 0, 4, 0, None, [], None, parent_call="a/4_0_0")
    assert _parent_ids([root]) == [""] and _parent_ids(kids) == ["3_0_1"] * 2
    assert _parent_ids([root, *kids]) == ["", "3_0_1", "3_0_1"]
    assert _parent_ids([kids[0], call, root]) == ["3_0_1", "a/4_0_0", ""]


def test_a_full_disk_is_one_line_and_the_file_reopens_at_its_last_commit(tmp_path):
    """The store on a 1 MiB tmpfs: appends until the disk is full give one StoreError line
    (errno 28) naming the file; the writer dies as the job would (in a forked child); with
    room again (remount) the same file reopens at its last commit, with no zero-filled rows
    and every row's status backed by its event."""
    import json
    import subprocess
    from flexmarl_hpc.store.tables import StoreError
    from test_checkpoint import tmpfs
    report = tmp_path / "report.json"
    with tmpfs(tmp_path, "1m") as mnt:
        path = mnt / "s.h5"
        pid = os.fork()
        if pid == 0:                                          # the writer: fills the disk, then dies
            out = {"committed": 0}
            try:
                s = StoreFile(path, AGENTS, {})
                for step in range(10_000):
                    first = s.samples["a"].append(sample_rows(s, "a", 64, step=step))
                    s.events.append(event_rows(s, "a", np.arange(first, first + 64), GENERATED))
                    s.flush()
                    out["committed"] = first + 64
            except StoreError as e:
                from flexmarl_hpc.ranks.job import exit_code
                out.update(msg=str(e), errno=e.errno, code=exit_code(e))
            finally:
                report.write_text(json.dumps(out))
                os._exit(0)
        os.waitpid(pid, 0)
        out = json.loads(report.read_text())
        msg = out.get("msg", "")
        assert out.get("errno") == 28 and "\n" not in msg and str(path) in msg and "no space left" in msg, out
        assert out["code"] == 75, out                         # the job's exit: requeue (it was 1)
        assert out["committed"] > 0
        subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)
        s = StoreFile(path, AGENTS, {})
        rows, ev = s.samples["a"].read(), s.events.read()
        assert len(rows) >= out["committed"] and len(ev) == len(rows)
        assert not (ev == np.zeros(1, ev.dtype)).any() and set(ev["row"].tolist()) == set(range(len(rows)))
        assert (rows["status"] == GENERATED).all()
        s.close()


def test_a_close_right_after_a_micro_batch_flush_commits_its_rows(tmp_path):
    """flush(full=False) writes rows that the next flush commits; a full flush (close) with
    nothing new queued must still commit them, not return early (it did: the rows were
    discarded by the next open)."""
    s = StoreFile(tmp_path / "s.h5", AGENTS, {})
    first = s.samples["a"].append(sample_rows(s, "a", 3))
    s.events.append(event_rows(s, "a", np.arange(first, first + 3), GENERATED))
    s.flush(full=False)
    s.close()
    s = StoreFile(tmp_path / "s.h5", AGENTS, {})
    assert not s.repaired and len(s.events.read()) == 3 and len(s.samples["a"].read()) == 3
    s.close()


def _reader(path):
    """A second process reading the store as `status` does (h5py in SWMR mode), holding it
    open until its stdin closes; returns once it has the file open."""
    import subprocess
    import sys
    code = ("import sys, h5py; f = h5py.File(sys.argv[1], 'r', swmr=True); print('open', flush=True); "
            "sys.stdin.read(); f.close()")
    p = subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "open"
    return p


def test_a_resume_waits_for_a_reader_to_close_the_store(tmp_path):
    """A requeued job's re-open met a `status --follow` reading the store: HDF5 refuses the
    writer's lock at once (errno 11, BlockingIOError) and the job FAILED
    (tests/slurm/test_status.py, clean-clone CI of a34d847). The re-open waits for the
    reader (which lets go 1 s after it opened) and resumes with every committed row."""
    import threading
    path = tmp_path / "s.h5"
    s = StoreFile(path, AGENTS, {})
    first = s.samples["a"].append(sample_rows(s, "a", 5))
    s.events.append(event_rows(s, "a", np.arange(first, first + 5), GENERATED))
    s.close()
    reader = _reader(path)
    timer = threading.Timer(1.0, reader.stdin.close)
    timer.start()
    try:
        s = StoreFile(path, AGENTS, {})
    finally:
        timer.cancel()
        reader.stdin.close()
        reader.wait(timeout=30)
    assert len(s.samples["a"].read()) == 5 and len(s.events.read()) == 5
    s.close()


def test_a_reader_that_keeps_the_store_open_is_one_line_naming_the_file(tmp_path, monkeypatch):
    from flexmarl_hpc.store import tables
    path = tmp_path / "s.h5"
    StoreFile(path, AGENTS, {}).close()
    monkeypatch.setattr(tables, "OPEN_WAIT_S", 0.3)
    reader = _reader(path)
    try:
        with pytest.raises(tables.StoreError) as e:
            StoreFile(path, AGENTS, {})
    finally:
        reader.stdin.close()
        reader.wait(timeout=30)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "open for 0.3 s" in msg, msg
    StoreFile(path, AGENTS, {}).close()              # the reader gone, it opens


def test_a_full_disk_or_quota_requeues_and_a_damaged_store_does_not():
    """run.py's exit code for a rank's store or checkpoint error: 75 (EXIT_REQUEUE, the one
    definition: every other use imports it) where the same command works once there is room;
    1 for a damaged store (a requeue would find it damaged again, and loop) or another error."""
    import ast
    import errno
    from pathlib import Path
    from flexmarl_hpc.runtime.requeue import EXIT_REQUEUE
    from flexmarl_hpc.ranks.job import exit_code
    from flexmarl_hpc.store.checkpoint import CheckpointError
    from flexmarl_hpc.store.checksum import Damage, StoreDamaged, StoreUnreadable
    from flexmarl_hpc.store.tables import StoreError
    assert EXIT_REQUEUE == 75
    assert exit_code(StoreError.of(Path("s.h5"), OSError(errno.ENOSPC, "No space left on device"))) == 75
    assert exit_code(StoreError.of(Path("s.h5"), OSError(errno.EDQUOT, "Disk quota exceeded"))) == 75
    assert exit_code(CheckpointError("v1.pt: no space left on device", errno.ENOSPC)) == 75
    assert exit_code(CheckpointError("v1.pt: quota", errno.EDQUOT)) == 75
    assert exit_code(StoreError.of(Path("s.h5"), OSError(errno.EIO, "I/O error"))) == 1
    assert exit_code(StoreDamaged("s.h5", [Damage("/events", 0, 512, 100)])) == 1
    assert exit_code(StoreUnreadable("s.h5: truncated HDF5 file")) == 1
    package = Path(__file__).resolve().parents[2] / "flexmarl_hpc"
    literal = [str(p.relative_to(package)) for p in sorted(package.rglob("*.py"))
               for n in ast.walk(ast.parse(p.read_text())) if type(getattr(n, "value", None)) is int
               and isinstance(n, ast.Constant) and n.value == 75]
    assert literal == ["runtime/requeue.py"], literal


def step_row(step, version):
    return {"step": [step], "version": [version], "t_end": [0.0], "n_samples": [1], "n_micro": [1], "loss": [0],
            "reward_mean": [step], "entropy": [0], "kl": [0], "grad_norm": [0], "staleness_max": [0],
            "staleness_mean": [0], "rows_offset": [0], "rows_len": [0]}


def three_steps(path):
    """A closed store: 3 steps of /steps and /metrics, 3 /samples rows of agent a, all READY."""
    s = StoreFile(path, AGENTS, {})
    for step in range(3):
        for a in AGENTS:
            s.steps[a].append(step_row(step, step + 1))
        s.metrics.append({c: [step] for c in ("step", "t", "wall", "samples", "tokens", "samples_per_s",
                                                "rollout_s", "train_s", "sync_s", "swap_s", "utilization",
                                                "staleness_max")})
    s.samples["a"].append(sample_rows(s, "a", 3))
    s.events.append(event_rows(s, "a", np.arange(3), GENERATED))
    s.samples["a"].patch([0, 1, 2], {"status": READY, "reward": 1.0, "advantage": 0.0})
    s.events.append(event_rows(s, "a", np.arange(3), READY, reward=1.0))
    s.flush()
    s.close()


FLIPS = {"/steps/a": ("superseded", b"\x01"), "/metrics": ("superseded", b"\x01"),
         "/samples/a": ("status", bytes([CONSUMED]))}


def flip(path, table):
    """Row 1 of `table` (committed, in its first chunk): one byte of a patched column changed
    in the file, as damage would (its Fletcher-32 then fails, its fixed columns verify)."""
    col, value = FLIPS[table]
    with h5py.File(path, "r") as f:
        ds = f[table]
        at = ds.id.get_chunk_info(0).byte_offset + ds.dtype.itemsize + ds.dtype.fields[col][1]
    with open(path, "r+b") as fh:
        fh.seek(at)
        fh.write(value)


@pytest.mark.parametrize("table", list(FLIPS))
def test_a_changed_patched_byte_without_a_tear_record_is_refused_and_the_file_left_as_it_was(tmp_path, table):
    """Issue 38: a `superseded` byte set to 1 (or a status byte changed) in a committed row
    passed as a torn write (those columns are left out of the crc records) and was "repaired".
    A torn write is accepted only with evidence: here no in-place write of the chunk was in
    flight (/inflight names none), so it is damage: refused in one line naming the table,
    the chunk and its rows, nothing written."""
    path = tmp_path / "s.h5"
    three_steps(path)
    flip(path, table)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(StoreDamaged) as e:
        StoreFile(path, AGENTS, {})
    msg = str(e.value)
    assert "\n" not in msg and f"checksum mismatch in {table} rows 0-2 (chunk at file offset" in msg, msg
    assert "chunk 0's patched columns changed, and no in-place write of it was in flight" in msg, msg
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    with pytest.raises(StoreDamaged):
        verify_path(path)                      # the pre-launch check and analyze say the same


@pytest.mark.parametrize("table", list(FLIPS))
def test_a_torn_patch_with_its_tear_record_is_mended_and_its_flags_derived_again(tmp_path, table):
    """The same bytes with the evidence a kill inside the patch's write leaves (/inflight names
    the chunk: written before the chunk, cleared after the commit): a torn write, mended, and
    the patched column derived again by the resume (statuses from /events; `superseded`: the
    last row of its step that the restored versions keep), so no step vanishes (199/200)."""
    path = tmp_path / "s.h5"
    three_steps(path)
    flip(path, table)
    with h5py.File(path, "r+") as f:
        i = [str(t) for t in f["commit"].attrs["tables"]].index(table)
        f["inflight"][2 * i:2 * i + 2] = [0, 1]
    s = StoreFile(path, AGENTS, {})
    assert any(f"rewrote the torn chunk of {table}" in r for r in s.repaired), s.repaired
    assert s.supersede({"a": 3, "b": 3}, first_logged=3) == 0
    s.close()
    col = FLIPS[table][0]
    with h5py.File(path, "r") as f:
        assert f[table][col].tolist() == ([READY] * 3 if col == "status" else [0, 0, 0])
        assert not f["inflight"][:].any()
    assert not verify_path(path)
    assert load_run(path).metrics.step.tolist() == [0, 1, 2]


def test_a_kill_inside_a_status_patch_leaves_its_tear_record_and_resumes(tmp_path):
    """The writer's side of the tear record: a full flush that patches a committed /samples
    row declares the chunk in /inflight before it writes it; killed inside that write (new
    bytes, old Fletcher-32), the re-open finds the record, mends the chunk and takes the
    statuses from the committed events."""
    from flexmarl_hpc.store.checksum import stamp
    path = tmp_path / "s.h5"
    three_steps(path)

    def write():
        s = StoreFile(path, AGENTS, {})
        t = s.samples["a"]

        def torn(c, raw, sums):
            old = np.frombuffer(t.ds.id.read_direct_chunk((c * t.chunk,))[1][-4:], np.uint8)
            stamp(raw, *sums)[-4:] = old
            t.ds.id.write_direct_chunk((c * t.chunk,), raw, 0)
            os.kill(os.getpid(), signal.SIGKILL)

        t._write_chunk = torn
        t.patch([1], {"status": CONSUMED, "trainer_step": 0})
        s.events.append(event_rows(s, "a", [1], CONSUMED, tstep=0))
        s.flush()
        return s

    in_child_then_kill(write)
    with h5py.File(path, "r", swmr=True) as f:
        i = [str(n) for n in f["commit"].attrs["tables"]].index("/samples/a")
        assert f["inflight"][2 * i:2 * i + 2].tolist() == [0, 1]
    s = StoreFile(path, AGENTS, {})
    assert any("rewrote the torn chunk of /samples/a rows 0-2" in r for r in s.repaired), s.repaired
    assert s.samples["a"].read()["status"].tolist() == [READY] * 3
    s.close()
    assert not verify_path(path)


def killed_with_repairs_due(path, orphan: bool):
    """A writer killed after a commit and a flush it did not commit: its flags set, 2 rows of
    /samples/a past the commit, and 2 READY statuses the committed events do not hold. With
    `orphan`, a committed /samples/b row names a parent (a/0_7) no row has, as a salvage by an
    earlier release left it."""
    def write():
        s = StoreFile(path, AGENTS, {})
        s.samples["a"].append(sample_rows(s, "a", 4))
        kids = sample_rows(s, "b", 2)
        kids["parent_id"] = [b"a/0_0", b"a/0_7" if orphan else b"a/0_1"]
        s.samples["b"].append(kids)
        s.events.append(event_rows(s, "a", np.arange(4), GENERATED))
        s.flush()
        s.samples["a"].append(sample_rows(s, "a", 2, step=1))
        s.samples["a"].patch([0, 1], {"status": READY, "reward": 1.0})
        s._commit = lambda counts: os.kill(os.getpid(), signal.SIGKILL)
        s.flush()
        return s

    in_child_then_kill(write)


def test_a_refused_resume_writes_nothing_though_repairs_were_due(tmp_path):
    """Issue 38: the re-open made its repairs (cleared the flags, cut uncommitted rows,
    restored statuses) and the resume refused afterwards (a sample without its parent's row,
    tree.py), so the refused store had changed. Every check now comes first, reading only
    (store.recovery.check_reopen): the store is byte-identical after the refusal."""
    from flexmarl_hpc.store.checksum import StoreInconsistent
    path = tmp_path / "s.h5"
    killed_with_repairs_due(path, orphan=True)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(StoreInconsistent) as e:
        StoreFile(path, AGENTS, {})
    assert "\n" not in str(e.value) and "b sample 0_1 (step 0) has no parent row (a/0_7)" in str(e.value)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


def test_the_reopen_makes_exactly_the_repairs_its_check_listed(tmp_path):
    """check_reopen is pure (the file unchanged) and lists the repairs; the re-open then
    makes those and no other."""
    from flexmarl_hpc.store.recovery import check_reopen
    from flexmarl_hpc.store.schema import table_names
    path = tmp_path / "s.h5"
    killed_with_repairs_due(path, orphan=False)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    plan = check_reopen(path, AGENTS, table_names(AGENTS))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    assert plan.flags and plan.cut == {"/samples/a": 2} and not plan.torn
    assert plan.restatus["a"][0].tolist() == [0, 1] and list(plan.restatus) == ["a"]
    s = StoreFile(path, AGENTS, {})
    assert s.repaired == plan.lines(), (s.repaired, plan.lines())
    assert s.samples["a"].read()["status"].tolist() == [GENERATED] * 4
    s.close()


def test_the_pre_launch_check_refuses_a_sample_without_its_parent_row(tmp_path):
    """The launcher's check_resumable makes the re-open's checks too: a store with an orphaned
    sample is refused in one line before any rank starts, the file as it was."""
    import yaml
    from flexmarl_hpc.config.load import load_config, to_dict
    from flexmarl_hpc.config.schema import ConfigError
    from flexmarl_hpc.launch.preflight import check_resumable
    cfg = load_config("configs/local.yaml", [f"run.output_dir={tmp_path}"])
    sp, li = cfg.agent_names
    s = StoreFile(tmp_path / f"{cfg.run.name}.h5", cfg.agent_names,
                  {"config_yaml": yaml.safe_dump(to_dict(cfg), sort_keys=False)})
    s.samples[sp].append(sample_rows(s, sp, 1))
    kid = sample_rows(s, li, 1)
    kid["sample_id"], kid["parent_id"] = b"0_1_0", b"0_0_9"
    s.samples[li].append(kid)
    s.close()
    before = hashlib.sha256(s.path.read_bytes()).hexdigest()
    with pytest.raises(ConfigError, match=f"cannot resume: .*{li} sample 0_1_0 \\(step 0\\) has no parent row"):
        check_resumable(cfg)
    assert hashlib.sha256(s.path.read_bytes()).hexdigest() == before


def test_the_reopen_check_holds_one_agents_columns_at_a_time(tmp_path):
    """check_reopen reads only the columns its checks need, one agent at a time, and keeps one
    copy of the sample ids: on 2 x 20,000 samples (the second agent's children of the first's)
    it allocates at most 300 bytes per sample (tracemalloc counts numpy's and h5py's arrays;
    every agent's whole records at once, two sorted copies of the ids and the events took 488
    per sample: bench/bench_reopen.py, docs/LOG.md 2026-11-29)."""
    import tracemalloc
    from flexmarl_hpc.store.recovery import check_reopen
    from flexmarl_hpc.store.schema import table_names
    n, path = 20_000, tmp_path / "s.h5"
    s = StoreFile(path, AGENTS, {})
    for i, a in enumerate(AGENTS):
        rows = np.zeros(n, s.samples[a].dtype)
        rows["sample_id"] = [f"{k}_{i}_0".encode() for k in range(n)]
        rows["parent_id"] = [f"{k}_0_0".encode() if i else b"" for k in range(n)]
        rows["status"], rows["trainer_step"] = GENERATED, -1
        rows["reward"] = rows["advantage"] = rows["t_ready"] = rows["t_consumed"] = np.nan
        first = s.samples[a].append(rows)
        ev = np.zeros(n, s.events.dtype)
        ev["agent"], ev["row"], ev["status"], ev["trainer_step"] = i, np.arange(first, first + n), GENERATED, -1
        s.events.append(ev)
    s.close()
    tracemalloc.start()
    try:
        plan = check_reopen(path, AGENTS, table_names(AGENTS))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not plan.restatus and not plan.torn
    assert peak / (2 * n) < 300, f"{peak / (2 * n):.0f} bytes per sample"   # 233 here
