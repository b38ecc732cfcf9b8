"""Held-out evaluation of an episode workflow (orchestrator/episode_eval.py): one greedy
episode per held-out example at every evaluation point, every agent held at that version
until the round is over, `ctx.metrics` averaged into /eval rows, failed episodes counted.
The replies come from the test (a scripted replica); the run: tests/e2e/test_episodes_e2e.py."""
from __future__ import annotations

import asyncio

import pytest

from flexmarl_hpc.config.schema import Config, RunConfig, WorkflowConfig
from flexmarl_hpc.orchestrator.episode_eval import EPISODE_BASE, EpisodeEvaluator
from flexmarl_hpc.workflows.episode import EpisodeRunner
from tests.helpers import STOP, WordConversation


async def judged(ctx, example):
    """The planner, then a solver for odd examples, whose first reply token is the metric;
    example 3 raises (a failed episode)."""
    r = await ctx.chat("planner", [{"role": "user", "content": f"plan {example['x']}"}], temperature=1.5)
    if example["x"] % 2:
        r = await ctx.chat("solver", [{"role": "user", "content": "solve"}])
    await asyncio.sleep(0)
    if example["x"] == 3:
        raise ValueError("boom")
    ctx.metrics["first"] = float(r.ids[0])
    return {"planner": 1.0, **({"solver": 1.0} if example["x"] % 2 else {})}


class Task:
    stop_tokens = frozenset({STOP})

    class stream:
        @staticmethod
        def heldout(n):
            return [{"x": i} for i in range(n)]


def evaluator(done=(), versions=None):
    cfg = Config(run=RunConfig(steps=2, eval_every=1, eval_inputs=4),
                 workflow=WorkflowConfig(episode="tests:judged", agents=["planner", "solver"], max_new_tokens=8))
    runner = EpisodeRunner(judged, cfg.agent_names, 0, 8, lambda agent: WordConversation())
    return EpisodeEvaluator(cfg, Task(), set(done), versions or {"planner": 0, "solver": 0}, runner)


def answer(ev, agent, version, first):
    calls = ev.ready(agent, version)
    ev.take(calls)
    return calls, ev.record(calls, [[first + c.example, STOP] for c in calls], version, 10.0)


def test_a_round_runs_one_greedy_episode_per_example_and_averages_its_metrics():
    ev = evaluator()
    assert ev.todo == [0, 1, 2] and ev.hold("solver") == 0 and not ev.finished()
    ev.start({"planner": 0, "solver": 0}, 1.0)
    assert ev.ready("planner", 1) == [] and len(ev.ready("planner", 0)) == 4
    req = ev.request(ev.ready("planner", 0)[0])
    assert len(req) == 5 and req[0] == "eval0_0_planner_0"          # no sampling of its own: greedy
    assert all(c.call.episode.episode == EPISODE_BASE for c in ev.ready("planner", 0))
    calls, done = answer(ev, "planner", 0, 10)
    assert done == [] and sorted(c.example for c in ev.ready("solver", 0)) == [1, 3]
    assert ev.hold("planner") == 0 and ev.pending_tokens("solver") > 0
    _, (res,) = answer(ev, "solver", 0, 20)
    # examples 0 and 2 end on the planner (10, 12), 1 on the solver (21), 3 failed
    assert res.point == 0 and res.summary == {"task/first": pytest.approx((10 + 21 + 12) / 3),
                                               "task/episodes_failed": 0.25}
    assert res.rows["agent"] == [b"", b""] and res.rows["n_inputs"] == [4, 4] and res.rows["version"] == [0, 0]
    assert ev.todo == [1, 2] and ev.hold("solver") == 1
    ev.start({"planner": 0, "solver": 0}, 11.0)
    assert 1 not in ev.rounds                            # no agent is at version 1 yet
    ev.start({"planner": 1, "solver": 0}, 12.0)
    assert len(ev.ready("planner", 1)) == 4
    ev.close()


def test_a_round_served_at_another_version_is_refused():
    ev = evaluator()
    ev.start({"planner": 0, "solver": 0}, 1.0)
    answer(ev, "planner", 0, 10)
    calls = ev.ready("solver", 0)
    ev.take(calls)
    with pytest.raises(AssertionError, match=r"eval of solver at 0 ran at versions \{1\}"):
        ev.record(calls, [[20, STOP] for _ in calls], 1, 10.0)     # a replica that held version 1
    ev.close()


def test_points_the_store_has_or_a_restored_version_passed_are_not_run_again():
    ev = evaluator(done={0}, versions={"planner": 1, "solver": 1})
    assert ev.todo == [1, 2] and ev.skipped == []
    ev = evaluator(versions={"planner": 2, "solver": 2})
    assert ev.todo == [2] and ev.skipped == [0, 1]


def test_every_point_not_yet_evaluated_is_kept_not_only_the_next():
    """With pipeline.max_staleness >= 1 an agent reaches version 1 while round 0 still runs;
    it must not train past 1 before a replica holds it (found as a deadlock: round 1 then
    waited for weights no trainer had any more)."""
    ev = evaluator()
    assert ev.hold("planner") == 0
    assert ev.keeps("planner", 0) and ev.keeps("planner", 1) and ev.keeps("planner", 2)
    ev.todo.remove(1)
    assert not ev.keeps("planner", 1)
