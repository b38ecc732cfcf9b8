"""Issue 40: a failed episode is visible and safe. Its error (kind, message, traceback) is a
/failures row of the store, its calls are DROPPED in the journal (never trained, not lost),
and a resume that replays the step keeps them dropped without recording the failure twice.
The experience is the orchestrator's (EpisodeExperience) on a real store; the replies come
from the test."""
from __future__ import annotations

import h5py
import numpy as np

from flexmarl_hpc.config.schema import Config, WorkflowConfig
from flexmarl_hpc.orchestrator.experience import EpisodeExperience
from flexmarl_hpc.store.tables import StoreFile
from flexmarl_hpc.store.schema import CONSUMED, DROPPED
from flexmarl_hpc.workflows.episode import EpisodeRunner
from tests.helpers import CharConversation, check_journal, EV_DROPPED, EV_GENERATED, STOP, Stream


async def flaky(ctx, example):
    """Episode 1 reads a key the example lacks; episode 2 returns a reward that is no number."""
    r = await ctx.chat("solver", [{"role": "user", "content": f"solve {example['x']}"}])
    if ctx.episode == 1:
        return {"solver": example["answer"]}
    return {"solver": float("nan") if ctx.episode == 2 else float(len(r.ids))}


class Task:
    stop_tokens = frozenset({STOP})
    stream = Stream()

    def runner(self, cfg, tools=None, record_tool=None):
        return EpisodeRunner(flaky, cfg.agent_names, cfg.run.seed, cfg.workflow.max_new_tokens,
                             lambda agent: CharConversation(), tools=tools, record_tool=record_tool)


class NoPool:
    def close(self) -> None:
        pass


def experience(path):
    cfg = Config(workflow=WorkflowConfig(episode="tests:flaky", agents=["solver"], group_size=4,
                                         inputs_per_step=1, max_new_tokens=4))
    store = StoreFile(path, cfg.agent_names, {})
    return EpisodeExperience(cfg, Task(), store, tools=NoPool()), store


def generate_step_0(exp) -> None:
    """Admit step 0 and answer each of its pending solver calls, as a replica would."""
    exp.admit_step(0)
    calls = list(exp.pending["solver"])
    exp.take_pending("solver", {id(n) for n in calls})
    exp.record_generation([(n, [5, 6, STOP], [-0.5] * 3) for n in calls], 0, 0)


def test_a_failed_episode_is_stored_with_its_traceback_and_its_calls_dropped(tmp_path):
    exp, store = experience(tmp_path / "s.h5")
    generate_step_0(exp)
    assert exp.batch_of("solver", 0) == 2 and exp.ready_count("solver", 0) == 2
    taken = exp.take_ready("solver", 0, 2)
    assert sorted(n.traj for n in taken) == [0, 3]
    exp.close()
    store.close()
    with h5py.File(tmp_path / "s.h5", "r") as f:
        assert f.attrs["schema_version"] == 6
        fails = f["failures"][:]
        rows = f["samples/solver"][:]
        ev = f["events"][:]
        assert len(f["tools"]) == 0                   # no longer an 'episode' /tools row
    assert fails[["step", "input_id", "traj"]].tolist() == [(0, 0, 1), (0, 0, 2)]
    assert fails["kind"].tolist() == [b"KeyError", b"ValueError"]
    assert fails["message"][0] == b"'answer'"
    assert b"reward for 'solver' is not a finite number: nan" in fails["message"][1]
    tb = fails["traceback"][0].decode()
    assert tb.startswith("Traceback (most recent call last)") and tb.rstrip().endswith("KeyError: 'answer'")
    assert 'return {"solver": example["answer"]}' in tb
    status = dict(zip(rows["traj"].tolist(), rows["status"].tolist()))
    assert status == {0: CONSUMED, 1: DROPPED, 2: DROPPED, 3: CONSUMED}
    assert np.isnan(rows["reward"][rows["status"] == DROPPED]).all()
    assert (rows["trainer_step"][rows["status"] == DROPPED] == -1).all()
    dropped_rows = np.flatnonzero(rows["status"] == DROPPED)
    for r in dropped_rows:
        assert ev["status"][ev["row"] == r].tolist() == [EV_GENERATED, EV_DROPPED]
    check_journal(tmp_path / "s.h5")


def test_a_resume_replaying_the_step_keeps_the_calls_dropped_and_the_failures_once(tmp_path):
    exp, store = experience(tmp_path / "s.h5")
    generate_step_0(exp)
    exp.close()
    store.close()                                      # killed before training: a resume
    exp, store = experience(tmp_path / "s.h5")
    exp.reload(0, {"solver": 0})
    assert not exp.pending["solver"] and exp.batch_of("solver", 0) == 2 and exp.ready_count("solver", 0) == 2
    exp.take_ready("solver", 0, 2)
    exp.close()
    store.close()
    with h5py.File(tmp_path / "s.h5", "r") as f:
        assert len(f["failures"]) == 2 and len(f["episodes"]) == 4
        assert sorted(f["samples/solver"]["status"].tolist()) == [CONSUMED, CONSUMED, DROPPED, DROPPED]
    check_journal(tmp_path / "s.h5")
