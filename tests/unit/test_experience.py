"""The experience store's over-provisioning, driven by hand in one process (real HDF5):
which inputs join a step's batch, what is dropped, and a late answer from a replica."""
import h5py
import numpy as np
import pytest

from flexmarl_hpc.workflows.build import build_task
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.orchestrator.experience import Experience
from flexmarl_hpc.store.tables import StoreFile
from flexmarl_hpc.store.schema import CONSUMED, DROPPED, GENERATED, READY
from tests.conftest import ROOT


@pytest.fixture
def exp(tmp_path):
    # 2 inputs per step + 1 extra; speaker answers 4 times, listener 4 times per message
    cfg = load_config(str(ROOT / "configs/local.yaml"),
                      ["workflow.inputs_per_step=2", "pipeline.overprovision=1"])
    store = StoreFile(tmp_path / "s.h5", cfg.agent_names, {})
    yield Experience(cfg, build_task(cfg), store)
    store.close()


def answer(exp, nodes, tokens):
    exp.record_generation([(n, list(tokens), [-1.0] * len(tokens)) for n in nodes], 0, 0)


def take_pending(exp, agent, inputs):
    """Dispatch: remove the pending nodes of these inputs, as the orchestrator does."""
    q = exp.pending[agent]
    out = [n for n in q if n.input_id in inputs]
    keep = [n for n in q if n.input_id not in inputs]
    q.clear()
    q.extend(keep)
    return out


def test_first_inputs_to_finish_form_the_batch_and_a_late_answer_is_dropped(exp):
    exp.admit_step(0)
    assert sorted({n.input_id for n in exp.pending["speaker"]}) == [0, 1, 2]
    on_replica = take_pending(exp, "speaker", {0, 1, 2})
    answer(exp, [n for n in on_replica if n.input_id in (1, 2)], [3, 4])
    late = [n for n in on_replica if n.input_id == 0]            # still on a replica

    answer(exp, take_pending(exp, "listener", {2}), [5])         # input 2 finishes first
    assert exp.joined[0] == [2]
    assert exp.ready_count("speaker", 0) == 4 and exp.ready_count("listener", 0) == 16
    # input 1's listener groups are READY (rewards known) but wait for the whole input
    listeners1 = take_pending(exp, "listener", {1})
    answer(exp, listeners1[:4], [5])
    assert exp.ready_count("listener", 0) == 16 and len(exp.held[1]) == 4
    answer(exp, listeners1[4:], [5])
    # the batch is full (2 inputs): input 0 is dropped, including what is on the replica
    assert exp.joined[0] == [2, 1] and 0 in exp.dropped
    assert all(n.status == DROPPED for n in late)
    answer(exp, late, [3, 4])                                    # the replica answers anyway
    assert not exp.pending["listener"], "a dropped input grew children"

    assert [len(exp.take_ready(a, 0, 999)) for a in ("speaker", "listener")] == \
        [exp.batch_size["speaker"], exp.batch_size["listener"]] == [8, 32]
    exp.store.flush()
    with h5py.File(exp.store.path, "r") as f:
        g = f["samples/speaker"]
        status, inp = g["status"][:], g["input_id"][:]
        assert set(inp[status == DROPPED]) == {0} and (status[inp != 0] == CONSUMED).all()
        ev = f["events"]
        rows0 = set(np.nonzero(inp == 0)[0])
        mine = [(r, s) for a, r, s in zip(ev["agent"][:], ev["row"][:], ev["status"][:])
                if a == 0 and r in rows0]
        assert sorted(s for _, s in mine) == [GENERATED] * 4 + [DROPPED] * 4   # written, then dropped
        assert READY not in {s for _, s in mine}


# -- resume: Experience.reload on a real HDF5 file, driven by hand -------------------------
def run_step(exp, step, consume=None):
    """Generate every turn of `step` (speaker answers, then listener), then consume up to
    `consume` samples of each agent (None: all of them)."""
    exp.admit_step(step)
    for agent in ("speaker", "listener"):
        nodes = [n for n in exp.pending[agent] if n.step == step]
        exp.pending[agent].clear()
        tok = [3, 4] if agent == "speaker" else [5]
        exp.record_generation([(n, tok, [-1.0] * len(tok)) for n in nodes], step, 0)
        exp.store.flush()
    for agent in ("speaker", "listener"):
        exp.take_ready(agent, step, exp.batch_size[agent] if consume is None else consume)


def file_state(path, agent):
    with h5py.File(path, "r", swmr=True) as f:
        g = f[f"samples/{agent}"][:]
        ev = f["events"][:]
    return g, ev[ev["agent"] == ["speaker", "listener"].index(agent)]


@pytest.fixture
def plain(tmp_path):
    cfg = load_config(str(ROOT / "configs/local.yaml"), ["workflow.inputs_per_step=2"])
    return cfg, build_task(cfg), tmp_path / "r.h5"


@pytest.mark.parametrize("restored", [1, 0], ids=["checkpoint-at-1", "no-checkpoint"])
def test_reload_requeues_what_the_trainers_lost_and_regenerates_nothing(plain, restored):
    cfg, task, path = plain
    store = StoreFile(path, cfg.agent_names, {})
    exp = Experience(cfg, task, store)
    run_step(exp, 0)                              # step 0 fully trained
    run_step(exp, 1, consume=4)                   # step 1: 4 of each agent consumed, then a crash
    # ... after a full commit (another agent's step, a log line): a micro-batch's own flush
    # is committed by the next flush, and the status fields of written rows follow later
    store.flush()
    before = {a: file_state(path, a)[0] for a in cfg.agent_names}
    store.f.close()                               # "crash": nothing after the last flush survives

    store = StoreFile(path, cfg.agent_names, {})
    exp = Experience(cfg, task, store)
    versions = {a: restored for a in cfg.agent_names}
    assert exp.reload(restored, versions) == 1
    for a in cfg.agent_names:                     # nothing to generate again, all of it trainable
        assert not exp.pending[a]
        for s in range(restored, 2):
            assert exp.ready_count(a, s) == exp.batch_size[a]
    store.flush()
    for a in cfg.agent_names:
        rows, ev = file_state(path, a)
        assert len(rows) == len(before[a]) == 2 * exp.batch_size[a]             # no new rows
        assert (rows["sample_id"] == before[a]["sample_id"]).all()
        kept = rows["step"] < restored
        assert (rows["status"][kept] == CONSUMED).all() and (rows["trainer_step"][kept] == 0).all()
        assert (rows["status"][~kept] == READY).all() and (rows["trainer_step"][~kept] == -1).all()
        requeued = np.nonzero((before[a]["status"] == CONSUMED) & ~kept)[0]
        assert len(requeued) == (4 if restored else 4 + exp.batch_size[a])
        for r in requeued:                        # consumed -> generated -> ready, in the journal
            assert ev["status"][ev["row"] == r].tolist()[-3:] == [CONSUMED, GENERATED, READY]
        for r in np.nonzero(before[a]["status"] == READY)[0]:   # already ready: no new event
            assert ev["status"][ev["row"] == r].tolist()[-1] == READY
            assert (ev["row"] == r).sum() == 2
    # the trainer takes the requeued samples again, exactly once
    for a in cfg.agent_names:
        for s in range(restored, 2):
            assert len(exp.take_ready(a, s, 999)) == exp.batch_size[a]
    store.close()
    for a in cfg.agent_names:
        rows, _ = file_state(path, a)
        assert (rows["status"] == CONSUMED).all() and (rows["trainer_step"] == rows["step"]).all()


def test_a_reload_with_agents_at_different_versions_keeps_each_agents_trained_samples_consumed(plain):
    """The speaker's checkpoint holds step 0 (version 1), the listener's none (version 0): the
    resume reloads from step 0 (the lowest version), and every committed CONSUMED sample an
    agent's restored trainer contains (trainer_step < that agent's version) stays CONSUMED,
    in memory and in the file, with no new event; only what each trainer lost is requeued."""
    cfg, task, path = plain
    store = StoreFile(path, cfg.agent_names, {})
    exp = Experience(cfg, task, store)
    run_step(exp, 0)                              # both agents train step 0
    run_step(exp, 1, consume=4)
    store.flush()
    before = {a: file_state(path, a) for a in cfg.agent_names}
    store.f.close()                               # "crash"

    store = StoreFile(path, cfg.agent_names, {})
    exp = Experience(cfg, task, store)
    versions = {"speaker": 1, "listener": 0}
    assert exp.reload(min(versions.values()), versions) == 1
    store.flush()
    for a in cfg.agent_names:
        rows, ev = file_state(path, a)
        old_rows, old_ev = before[a]
        kept = (old_rows["status"] == CONSUMED) & (old_rows["trainer_step"] < versions[a])
        assert kept.sum() == (exp.batch_size[a] if versions[a] else 0)
        assert (rows["status"][kept] == CONSUMED).all() and (rows["trainer_step"][kept] == 0).all(), a
        assert all((ev["row"] == r).sum() == (old_ev["row"] == r).sum() for r in np.nonzero(kept)[0]), a
        assert (rows["status"][~kept] == READY).all(), a                     # the rest: trainable again
        assert [exp.ready_count(a, s) for s in (0, 1)] == [0 if versions[a] else exp.batch_size[a],
                                                          exp.batch_size[a]], a
    store.close()


def test_an_answer_with_more_log_probs_than_tokens_is_refused_by_name(exp):
    """Each response's log-probs go to its own token positions in the pool: one too many
    would land on the next sample's prompt, so the journal refuses it and names the sample."""
    exp.admit_step(0)
    nodes = take_pending(exp, "speaker", {0})
    batch = [(n, [3, 4], [-1.0, -1.0]) for n in nodes]
    batch[1] = (nodes[1], [3, 4], [-1.0, -1.0, -1.0])
    with pytest.raises(ValueError, match=f"speaker sample {nodes[1].sample_id}: 3 log-probs for 2"):
        exp.record_generation(batch, 0, 0)


def reload_without(plain, versions, keep):
    """Two steps, the speaker's checkpoint at 1, then a reload from a store that lost rows:
    `keep(node)` says which journalled nodes survived (a salvaged store)."""
    cfg, task, path = plain
    store = StoreFile(path, cfg.agent_names, {})
    exp = Experience(cfg, task, store)
    run_step(exp, 0)
    run_step(exp, 1, consume=4)
    store.flush()
    store.f.close()
    store = StoreFile(path, cfg.agent_names, {})
    exp = Experience(cfg, task, store)
    load = exp.journal.load
    exp.journal.load = lambda first: [n for n in load(first) if keep(n)]
    return exp, store


def test_a_reload_trains_a_step_an_agent_is_past_without_the_inputs_salvage_lost(plain):
    """Input 0 (step 0) and input 2 (step 1) lost whole: the speaker's checkpoint holds step 0,
    so no weights remain to sample input 0 again: the listener's step 0 goes on without it
    (half its batch), nothing pending for it. Step 1 is ahead of every checkpoint: input 2 is
    sampled again (its roots pending), its batch whole (issue 38: the resume waited for ever)."""
    versions = {"speaker": 1, "listener": 0}
    exp, store = reload_without(plain, versions, lambda n: n.input_id not in (0, 2))
    assert exp.reload(0, versions) == 1
    assert exp.lost_inputs == {0: {0}}
    half = exp.batch_size["listener"] // 2
    assert exp.batch_of("listener", 0) == exp.ready_count("listener", 0) == half
    assert exp.loss_scale("listener", 0) == 1 / half
    assert sorted({n.input_id for n in exp.pending["speaker"]}) == [2]
    assert not exp.pending["listener"] and exp.batch_of("listener", 1) == exp.batch_size["listener"]
    assert all(n.input_id != 0 for n in exp.nodes.values())
    store.close()


def test_a_reload_refuses_a_sample_whose_parent_row_is_gone_before_writing(plain):
    """A listener row whose speaker parent is not in the store (salvaged by a release that
    kept orphans): one clear error, raised before the reload journals anything (the
    TypeError deep in a reward function was issue 38's crash)."""
    from flexmarl_hpc.store.checksum import StoreInconsistent
    versions = {"speaker": 0, "listener": 0}
    exp, store = reload_without(plain, versions, lambda n: not (n.agent == "speaker" and n.input_id == 2))
    n_events = len(store.events.read())
    with pytest.raises(StoreInconsistent, match=r"listener sample 2_1_\d+ \(step 1\) has no parent row"):
        exp.reload(0, versions)
    assert len(store.events.read()) == n_events
    store.close()
