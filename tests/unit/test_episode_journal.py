"""Issue 35: no sample trains without its reward. An episode waiting on the in-process tool
pool ends whenever the episodes' loop next runs after the worker's result came in: a worker
result reaches that loop through loop.call_soon_threadsafe from the executor's thread (what
asyncio's run_in_executor does), so a step's admission, which runs the loop to start its
episodes, may be where an earlier example's episodes end and its calls become READY. Those
READY changes must reach the journal like a poll's, and the experience must refuse to hand a
trainer a sample the journal does not have READY with a finite reward and advantage."""
from __future__ import annotations

import asyncio
import math
import threading

import pytest

from flexmarl_hpc.config.schema import Config, WorkflowConfig
from flexmarl_hpc.orchestrator.episodes import EpisodeTree
from flexmarl_hpc.orchestrator.experience import EpisodeExperience, NotReady
from flexmarl_hpc.store.tables import StoreFile
from flexmarl_hpc.tools.pool import Called
from flexmarl_hpc.workflows.episode import EpisodeRunner
from tests.helpers import CharConversation, check_journal, STOP, Stream


def count(ids):
    return len(ids)


async def reward_on_a_worker(ctx, example):
    """with_tools' shape (tests/e2e/episodes.py): a solver call, then the reward from a worker."""
    r = await ctx.chat("solver", [{"role": "user", "content": f"solve {example['x']}"}])
    done = await ctx.call(count, r.ids)
    return {"solver": float(done.value + ctx.episode)}


class HeldPool:
    """WorkerPool's interface; each call's result is held until `release`, which delivers it
    from another thread as the executor's done-callback does (call_soon_threadsafe)."""

    def __init__(self):
        self.held: list = []

    async def call(self, fn, *args, timeout_s=None):
        future = asyncio.get_running_loop().create_future()
        self.held.append((future, fn(*args)))
        return await future

    def release(self) -> None:
        def deliver():
            for future, value in self.held:
                future.get_loop().call_soon_threadsafe(future.set_result, Called(value, "ok", 0.0))
        t = threading.Thread(target=deliver)
        t.start()
        t.join()
        self.held = []

    def close(self) -> None:
        pass


class Task:
    stop_tokens = frozenset({STOP})
    stream = Stream()

    def runner(self, cfg, tools=None, record_tool=None):
        return EpisodeRunner(reward_on_a_worker, cfg.agent_names, cfg.run.seed, cfg.workflow.max_new_tokens,
                             lambda agent: CharConversation(), tools=tools, record_tool=record_tool)


@pytest.fixture
def held(tmp_path):
    """Step 0's episodes answered and waiting on the pool (none of them ended yet)."""
    cfg = Config(workflow=WorkflowConfig(episode="tests:reward_on_a_worker", agents=["solver"], group_size=2,
                                         inputs_per_step=1, max_new_tokens=4))
    store, pool = StoreFile(tmp_path / "s.h5", cfg.agent_names, {}), HeldPool()
    exp = EpisodeExperience(cfg, Task(), store, tools=pool)
    exp.admit_step(0)
    calls = list(exp.pending["solver"])
    exp.take_pending("solver", {id(n) for n in calls})
    exp.record_generation([(n, [5, 6, STOP], [-0.5] * 3) for n in calls], 0, 0)
    assert exp.waiting() and not exp.poll().ready and len(pool.held) == 2
    yield exp, pool, store, calls
    exp.close()
    store.close()


def test_episodes_that_end_while_the_next_step_is_admitted_journal_their_ready(held):
    exp, pool, store, calls = held
    pool.release()                    # the worker's results are on the loop ...
    exp.admit_step(1)                 # ... which starting step 1's episodes runs
    assert exp.ready_count("solver", 0) == 2
    taken = exp.take_ready("solver", 0, 2)
    assert {id(n) for n in taken} == {id(n) for n in calls} and all(math.isfinite(n.advantage) for n in taken)
    store.flush()
    check_journal(store.path)         # generated -> ready -> consumed, reward and advantage set


def test_a_sample_the_journal_has_not_made_ready_is_refused_naming_it(held):
    exp, pool, store, calls = held
    pool.release()
    EpisodeTree.poll(exp)             # the tree alone: READY in memory, never journalled
    assert exp.ready_count("solver", 0) == 2
    with pytest.raises(NotReady, match=r"^solver sample 0_0_0: not ready in the journal .*refused"):
        exp.take_ready("solver", 0, 2)
    assert exp.ready_count("solver", 0) == 2       # nothing consumed


def test_a_sample_without_a_finite_advantage_is_refused_naming_it(held):
    exp, pool, store, calls = held
    pool.release()
    exp.poll()
    calls[1].advantage = float("nan")
    with pytest.raises(NotReady, match=r"^solver sample 0_0_1: .*advantage nan"):
        exp.take_ready("solver", 0, 2)


@pytest.mark.parametrize("reward", [float("nan"), [1.0, float("inf")]])
def test_an_episode_returning_a_reward_that_is_not_finite_fails_naming_the_agent(reward):
    from flexmarl_hpc.workflows.episode import check_rewards
    with pytest.raises(ValueError, match=r"reward for 'solver' is not a finite number"):
        check_rewards({"solver": reward}, {"solver": 2 if isinstance(reward, list) else 1}, ["solver"])
