"""The experience store's over-provisioning, driven by hand in one process (real HDF5):
which inputs join a step's batch, what is dropped, and a late answer from a replica."""
import h5py
import numpy as np
import pytest

from flexmarl_hpc.build import build_task
from flexmarl_hpc.config import load_config
from flexmarl_hpc.experience import Experience
from flexmarl_hpc.store import CONSUMED, DROPPED, GENERATED, READY, StoreFile
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
