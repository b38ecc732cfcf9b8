"""Issue 38: a resume never changes the store before it knows it can finish. A refusal the
file alone decides is found by reading only (store.recovery); an episode replay that
mismatches comes after the re-open's repairs, which are then put back (store/undo.py):
the store stays byte-identical, and a resume that passes keeps no copy behind."""
from __future__ import annotations

import hashlib

import pytest

from flexmarl_hpc.config.schema import Config, WorkflowConfig
from flexmarl_hpc.orchestrator.episodes import ReplayMismatch
from flexmarl_hpc.orchestrator.experience import EpisodeExperience
from flexmarl_hpc.store.tables import StoreFile
from flexmarl_hpc.store.undo import copy_path
from flexmarl_hpc.workflows.episode import EpisodeRunner
from tests.helpers import STOP, CharConversation, Stream, in_child_then_kill


async def solve(ctx, example):
    await ctx.chat("solver", [{"role": "user", "content": f"solve {example['x']}"}])
    return {"solver": 1.0}


async def solve_otherwise(ctx, example):            # another prompt on replay: nondeterministic
    await ctx.chat("solver", [{"role": "user", "content": f"work out {example['x']}"}])
    return {"solver": 1.0}


class Task:
    stop_tokens = frozenset({STOP})
    stream = Stream()

    def __init__(self, fn):
        self.fn = fn

    def runner(self, cfg, tools=None, record_tool=None):
        return EpisodeRunner(self.fn, cfg.agent_names, cfg.run.seed, cfg.workflow.max_new_tokens,
                             lambda agent: CharConversation(), tools=tools, record_tool=record_tool)


CFG = Config(workflow=WorkflowConfig(episode="tests:solve", agents=["solver"], group_size=2, inputs_per_step=1,
                                     max_new_tokens=4))


@pytest.fixture
def killed(tmp_path):
    """A store whose writer was SIGKILLed after step 0's calls were generated, made ready and
    consumed: its re-open has repairs to make (the open-for-write flags at least)."""
    path = tmp_path / "run.h5"

    def first_run():
        store = StoreFile(path, CFG.agent_names, {})
        exp = EpisodeExperience(CFG, Task(solve), store)
        exp.admit_step(0)
        calls = list(exp.pending["solver"])
        exp.take_pending("solver", {id(n) for n in calls})
        exp.record_generation([(n, [5, 6, STOP], [-0.5] * 3) for n in calls], 0, 0)
        exp.poll()
        assert len(exp.take_ready("solver", 0, 2)) == 2
        store.flush()
        return store

    in_child_then_kill(first_run)
    return path


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_resume_whose_replay_mismatches_is_refused_with_the_store_byte_identical(killed):
    before = sha(killed)
    store = StoreFile(killed, CFG.agent_names, {}, undoable=True)
    assert store.repaired, "the re-open repaired nothing: the test would not show the undo"
    exp = EpisodeExperience(CFG, Task(solve_otherwise), store)
    with pytest.raises(ReplayMismatch, match="deterministic.*left as it was before this resume"):
        exp.reload(0, {"solver": 0})
    exp.close()
    store.close()
    assert sha(killed) == before
    assert not copy_path(killed).exists()
    # and the same command with the episode as it was resumes
    store = StoreFile(killed, CFG.agent_names, {}, undoable=True)
    exp = EpisodeExperience(CFG, Task(solve), store)
    assert exp.reload(0, {"solver": 0}) == 0
    store.settle()
    assert not copy_path(killed).exists()
    exp.close()
    store.close()
