"""Episode workflows on the orchestrator's side (orchestrator/episodes.py): dynamic calls
become nodes, GRPO groups over calls, the step's batch known only at its end, replay on
resume, failed episodes. The replies come from a scripted "replica" (the test); the
conversations are a whitespace tokenizer, so prompts are readable."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from flexmarl_hpc.config.schema import Config, WorkflowConfig
from flexmarl_hpc.learn.grpo import call_advantages
from flexmarl_hpc.orchestrator.episodes import EpisodeTree, ReplayMismatch
from flexmarl_hpc.store.schema import CONSUMED, DROPPED, GENERATED, READY
from flexmarl_hpc.workflows.episode import EpisodeRunner
from tests.helpers import STOP, Stream, WordConversation


async def skewed(ctx, example):
    """The planner asks 1 + (x + episode) % 3 solvers; each solver's reply text is its reward."""
    plan = await ctx.chat("planner", [{"role": "user", "content": f"plan {example['x']}"}])
    k = 1 + (example["x"] + ctx.episode) % 3
    replies = await asyncio.gather(*(ctx.chat("solver", [{"role": "user", "content": f"solve {j}"}])
                                     for j in range(k)))
    rewards = [0.0] * k
    for r in replies:
        rewards[r.call] = float(r.ids[0] % 2)
    return {"planner": float(plan.ids[0] % 2), "solver": rewards}


class Task:
    stop_tokens = frozenset({STOP})
    stream = Stream()

    def __init__(self, fn):
        self.fn = fn

    def runner(self, cfg):
        return EpisodeRunner(self.fn, cfg.agent_names, cfg.run.seed, cfg.workflow.max_new_tokens,
                             lambda agent: WordConversation())


def config(n_in=2, group=3, **workflow):
    cfg = Config(workflow=WorkflowConfig(episode="tests:skewed", agents=["planner", "solver"],
                                         group_size=group, inputs_per_step=n_in, max_new_tokens=8, **workflow))
    return cfg


def reply_for(node):
    """The scripted replica: a reply whose first token depends on the call."""
    return [4 + (node.input_id * 7 + node.traj * 3 + node.turn) % 5, STOP]


def serve(tree, agents=("planner", "solver")):
    """Answer every pending call until none is left; returns the nodes answered, in order."""
    done = []
    while any(tree.pending[a] for a in agents):
        for a in agents:
            batch = list(tree.pending[a])
            tree.take_pending(a, {id(n) for n in batch})
            if batch:
                tree.record_generation([(n, reply_for(n), [-0.5] * 2) for n in batch], 0, 0)
                done += batch
    return done


def test_calls_per_agent_vary_and_the_batch_is_known_when_the_step_ends():
    tree = EpisodeTree(config(), Task(skewed))
    tree.admit_step(0)
    assert len(tree.pending["planner"]) == 6 and not tree.pending["solver"]
    assert tree.batch_of("solver", 0) is None
    serve(tree)
    solver_calls = [n for n in tree.nodes.values() if n.agent == "solver"]
    per_episode = {(n.input_id, n.traj): 0 for n in solver_calls}
    for n in solver_calls:
        per_episode[(n.input_id, n.traj)] += 1
    assert sorted(set(per_episode.values())) == [1, 2, 3]          # not constant
    assert tree.batch_of("solver", 0) == len(solver_calls) == sum(per_episode.values())
    assert tree.batch_of("planner", 0) == 6
    assert all(n.status == READY for n in tree.nodes.values())
    assert tree.ready_count("solver", 0) == len(solver_calls)


def test_advantages_follow_the_call_groups_of_each_example():
    tree = EpisodeTree(config(n_in=1, group=3), Task(skewed))
    tree.admit_step(0)
    serve(tree)
    mine = [n for n in tree.nodes.values() if n.agent == "solver"]
    want = call_advantages([(n.traj, n.turn, n.reward) for n in mine])
    assert np.allclose([n.advantage for n in mine], want)
    # the rewards are the replies' parity, as the episode said (call index -> reward)
    assert all(n.reward == float(n.response[0] % 2) for n in mine)


def test_call_advantages_hand_computed():
    # index 0 in episodes 0,1,2 (rewards 1,0,1); index 1 in 0,2 (1,0); index 2 only in 1
    calls = [(0, 0, 1.0), (1, 0, 0.0), (2, 0, 1.0), (0, 1, 1.0), (2, 1, 0.0), (1, 2, 0.0)]
    got = call_advantages(calls, eps=0.0)
    s0 = np.sqrt(2 / 9)                       # population std of 1, 0, 1
    # the lone index-2 call against the episode means 1, 0, 0.5 (mean 0.5, std sqrt(1/6))
    want = [1 / 3 / s0, -2 / 3 / s0, 1 / 3 / s0, 1.0, -1.0, -0.5 / np.sqrt(1 / 6)]
    assert np.allclose(got, want)
    assert call_advantages([(0, 0, 1.0)]).tolist() == [0.0]


def test_parent_is_the_call_completed_last_before():
    tree = EpisodeTree(config(n_in=1, group=1), Task(skewed))
    tree.admit_step(0)
    serve(tree)
    solver = [n for n in tree.nodes.values() if n.agent == "solver"]
    assert solver and all(n.parent_call == "planner/0_0_0" for n in solver)
    assert tree.nodes[("planner", "0_0_0")].parent_call == ""


def test_replay_answers_recorded_calls_and_requeues_uncommitted_consumption():
    cfg = config()
    first = EpisodeTree(cfg, Task(skewed))
    first.admit_step(0)
    serve(first)
    taken = first.take_ready("solver", 0, 4)
    for n in taken:                            # consumed by step 0, which no checkpoint holds
        assert n.status == CONSUMED
    journal = [n for n in first.nodes.values()]
    # what the journal would load: unlinked copies with status and responses
    from flexmarl_hpc.orchestrator.tree import Node
    loaded = [Node(n.agent, n.turn, n.step, n.input_id, n.traj, None, [], None, prompt=list(n.prompt),
                   response=list(n.response), logprobs=list(n.logprobs), status=n.status,
                   trainer_step=n.trainer_step, row=i) for i, n in enumerate(journal)]
    again = EpisodeTree(cfg, Task(skewed))
    requeue, ch = again.restore(loaded, 0, {"planner": 0, "solver": 0})
    assert len(requeue) == 4 and not any(again.pending[a] for a in again.agents)   # nothing re-asked
    assert again.batch_of("solver", 0) == first.batch_of("solver", 0)
    assert again.ready_count("solver", 0) == first.batch_of("solver", 0)          # all trainable again
    # journalled READY rows stay as they are; only the requeued ones are made READY again
    assert {(n.agent, n.sample_id) for n in ch.ready} == {(n.agent, n.sample_id) for n in requeue}


def test_a_nondeterministic_episode_is_refused_on_replay():
    cfg = config(n_in=1, group=1)
    first = EpisodeTree(cfg, Task(skewed))
    first.admit_step(0)
    serve(first)
    from flexmarl_hpc.orchestrator.tree import Node
    loaded = [Node(n.agent, n.turn, n.step, n.input_id, n.traj, None, [], None, prompt=list(n.prompt) + [9],
                   response=list(n.response), logprobs=list(n.logprobs), status=GENERATED)
              for n in first.nodes.values()]
    with pytest.raises(ReplayMismatch, match="deterministic"):
        EpisodeTree(cfg, Task(skewed)).restore(loaded, 0, {"planner": 0, "solver": 0})


async def broken(ctx, example):
    await ctx.chat("planner", [{"role": "user", "content": "hi"}])
    if ctx.episode == 1:
        raise KeyError("no such field")
    return {"planner": 1.0}


def test_an_episode_that_raises_gives_its_calls_reward_zero_with_on_error_zero():
    tree = EpisodeTree(config(n_in=1, group=2, on_error="zero"), Task(broken))
    tree.admit_step(0)
    serve(tree)
    by_ep = {n.traj: n.reward for n in tree.nodes.values()}
    assert by_ep == {0: 1.0, 1: 0.0}
    assert [f.error for f in tree.failed] == ["KeyError: 'no such field'"]
    assert tree.batch_of("solver", 0) == 0                   # never called: an empty step
    assert tree.batch_of("planner", 0) == 2


def test_an_episode_that_raises_has_its_calls_dropped_by_default_and_its_traceback_kept():
    tree = EpisodeTree(config(n_in=1, group=2), Task(broken))
    ready = tree.admit_step(0).ready
    answered = serve(tree)
    good, bad = sorted(answered, key=lambda n: n.traj)
    assert (good.status, good.reward, bad.status, bad.reward) == (READY, 1.0, DROPPED, None)
    assert good.advantage == 0.0                             # its group is itself alone
    assert tree.batch_of("planner", 0) == 1 and tree.ready_count("planner", 0) == 1
    (f,) = tree.failed
    assert (f.failure.kind, f.failure.message) == ("KeyError", "'no such field'")
    assert 'raise KeyError("no such field")' in f.failure.traceback and not ready
    lines = tree.failures.take_lines()
    assert lines[0].startswith("episode failed (first KeyError): step 0, example 0, episode 1")
    assert lines[1:] == ["step 0: 1 of 2 episodes failed (KeyError 1)"]
    assert tree.failures.stop is None                        # 1 of 2 is not more than 0.5


def test_more_than_max_failure_rate_of_a_steps_episodes_failing_says_stop():
    tree = EpisodeTree(config(n_in=1, group=2, max_failure_rate=0.4), Task(broken))
    tree.admit_step(0)
    serve(tree)
    assert tree.failures.stop.startswith("stopping the run: 1 of the 2 episodes of step 0 failed (KeyError 1), "
                                         "more than workflow.max_failure_rate=0.4; first (example 0, episode 1)")
    assert "Traceback (most recent call last)" in tree.failures.stop


async def fails_in_flight(ctx, example):
    """A solver call goes out, then the episode raises while it is on a replica."""
    solver = asyncio.ensure_future(ctx.chat("solver", [{"role": "user", "content": "s"}]))
    await ctx.chat("planner", [{"role": "user", "content": "p"}])
    if ctx.episode == 0:
        raise ValueError("bad parse")
    await solver
    return {"planner": 1.0, "solver": 1.0}


@pytest.mark.parametrize("on_error", ["drop", "zero"])
def test_a_call_in_flight_when_its_episode_fails_is_dropped_or_trained_at_reward_zero(on_error):
    """The reply of a call whose episode already failed: dropped (on_error drop) or READY
    with reward 0 (zero); before, it stayed GENERATED and the step never completed."""
    tree = EpisodeTree(config(n_in=1, group=2, on_error=on_error), Task(fails_in_flight))
    tree.admit_step(0)
    solvers = list(tree.pending["solver"])
    tree.take_pending("solver", {id(n) for n in solvers})            # on a replica
    answer(tree, "planner")
    assert [f.error for f in tree.failed] == ["ValueError: bad parse"]
    ch = tree.record_generation([(n, reply_for(n), [-0.5] * 2) for n in solvers], 0, 0)
    s0 = next(n for n in solvers if n.traj == 0)
    if on_error == "drop":
        assert s0.status == DROPPED and s0 in ch.dropped and tree.batch_of("solver", 0) == 1
    else:
        assert s0.status == READY and s0.reward == 0.0 and s0 in ch.ready and tree.batch_of("solver", 0) == 2
    assert tree.ready_count("solver", 0) == tree.batch_of("solver", 0)
    tree.close()


async def bad_return(ctx, example):
    await ctx.chat("solver", [{"role": "user", "content": "hi"}])
    return {"solver": [1.0, 0.0]}                             # two rewards for one call


def test_a_reward_list_of_the_wrong_length_fails_the_episode_with_a_reason():
    tree = EpisodeTree(config(n_in=1, group=1), Task(bad_return))
    tree.admit_step(0)
    serve(tree)
    assert "2 rewards for 'solver', which was called 1 times" in tree.failed[0].error


async def slow_end(ctx, example):
    """An episode that, after its call, waits on something else (a timer here, a tool in a
    run): on a replay it ends after restore() returned."""
    await ctx.chat("planner", [{"role": "user", "content": "hi"}])
    await asyncio.sleep(0.01)
    return {"planner": float(ctx.episode)}


def test_a_replayed_example_that_ends_after_restore_does_not_journal_ready_twice():
    import time
    from flexmarl_hpc.orchestrator.tree import Node
    cfg = config(n_in=1, group=2)
    first = EpisodeTree(cfg, Task(slow_end))
    first.admit_step(0)
    serve(first)
    while first.waiting():
        time.sleep(0.005)
        first.poll()
    assert all(n.status == READY for n in first.nodes.values())
    loaded = [Node(n.agent, n.turn, n.step, n.input_id, n.traj, None, [], None, prompt=list(n.prompt),
                   response=list(n.response), logprobs=list(n.logprobs), status=READY)
              for n in first.nodes.values()]
    again = EpisodeTree(cfg, Task(slow_end))
    requeue, ch = again.restore(loaded, 0, {"planner": 0, "solver": 0})
    assert not requeue and not ch.ready and again.ready_count("planner", 0) == 0     # still waiting
    later = []
    while again.waiting():
        time.sleep(0.005)
        later += again.poll().ready
    assert later == []                                 # the file has them READY already
    assert again.ready_count("planner", 0) == 2        # trainable again all the same
    again.close()


async def settles_planner(ctx, example):
    """The planner's reward is known from its own reply: settled before the solver runs."""
    plan = await ctx.chat("planner", [{"role": "user", "content": f"plan {example['x']}"}])
    ctx.settle("planner", float(plan.ids[0] % 2))
    if ctx.args.get("chat_after"):
        await ctx.chat("planner", [{"role": "user", "content": "again"}])
    await ctx.chat("solver", [{"role": "user", "content": "solve"}])
    return {"solver": 1.0, **({"planner": 0.0} if ctx.args.get("return_settled") else {})}


def settle_tree(group=3, **args):
    cfg = config(n_in=1, group=group)
    task = Task(settles_planner)
    runner = EpisodeRunner(settles_planner, cfg.agent_names, cfg.run.seed, 8, lambda agent: WordConversation(),
                           args=args)
    task.runner = lambda cfg: runner
    return EpisodeTree(cfg, task)


def answer(tree, agent):
    batch = list(tree.pending[agent])
    tree.take_pending(agent, {id(n) for n in batch})
    return tree.record_generation([(n, reply_for(n), [-0.5] * 2) for n in batch], 0, 0)


def test_a_settled_agent_is_ready_and_its_batch_known_before_the_episodes_end():
    tree = settle_tree()
    tree.admit_step(0)
    ch = answer(tree, "planner")
    # every episode of the example settled the planner: its group is trainable, the solver runs
    assert sorted(n.traj for n in ch.ready) == [0, 1, 2] and all(n.agent == "planner" for n in ch.ready)
    assert tree.batch_of("planner", 0) == 3 and tree.ready_count("planner", 0) == 3
    assert tree.batch_of("solver", 0) is None and len(tree.pending["solver"]) == 3
    planners = sorted((n for n in tree.nodes.values() if n.agent == "planner"), key=lambda n: n.traj)
    want = call_advantages([(n.traj, 0, float(reply_for(n)[0] % 2)) for n in planners])
    assert [n.reward for n in planners] == [float(reply_for(n)[0] % 2) for n in planners]
    assert np.allclose([n.advantage for n in planners], want)
    answer(tree, "solver")
    assert tree.batch_of("solver", 0) == 3 and not tree.failed


def test_a_partly_settled_example_waits_for_its_last_episode():
    tree = settle_tree(group=2)
    tree.admit_step(0)
    first = tree.pending["planner"][0]
    tree.take_pending("planner", {id(first)})
    assert not tree.record_generation([(first, reply_for(first), [-0.5] * 2)], 0, 0).ready
    assert tree.batch_of("planner", 0) is None
    tree.close()


@pytest.mark.parametrize("args, error", [
    ({"chat_after": True}, "ctx.chat('planner'): the agent was settled in this episode (ctx.settle)"),
    ({"return_settled": True}, "reward returned for ['planner'], settled earlier (ctx.settle)")])
def test_a_settled_agent_called_or_rewarded_again_fails_the_episode_but_keeps_its_reward(args, error):
    tree = settle_tree(group=1, **args)
    tree.admit_step(0)
    (planner,) = answer(tree, "planner").ready
    if not args.get("chat_after"):
        answer(tree, "solver")
    assert [f.error for f in tree.failed] == [f"ValueError: {error}"]
    assert planner.reward == float(reply_for(planner)[0] % 2)        # settled: kept
    assert tree.batch_of("planner", 0) == 1


async def own_sampling(ctx, example):
    """The planner at its own temperature, one solver at its own top_p, one at the run's."""
    bad = ctx.args.get("bad")
    if bad:
        await ctx.chat("planner", [{"role": "user", "content": "p"}], **bad)
    await ctx.chat("planner", [{"role": "user", "content": "p"}], temperature=0.5)
    await asyncio.gather(ctx.chat("solver", [{"role": "user", "content": "a"}], top_p=0.9),
                         ctx.chat("solver", [{"role": "user", "content": "b"}]))
    return {"planner": 1.0, "solver": 1.0}


def sampling_tree(**args):
    cfg = config(n_in=1, group=1)
    runner = EpisodeRunner(own_sampling, cfg.agent_names, cfg.run.seed, 8, lambda agent: WordConversation(),
                           args=args, sampling=(0.7, 0.95))
    task = Task(own_sampling)
    task.runner = lambda cfg: runner
    return EpisodeTree(cfg, task)


def test_a_calls_own_temperature_and_top_p_reach_its_generation_request():
    """ctx.chat(temperature=, top_p=): the request carries (temperature, top_p), the run's
    (rollout.temperature, top_p) standing in for the one not given; a call without either
    sends the 5-field request, sampled with the batch's params."""
    from flexmarl_hpc.rollout.base import GenRequest
    from flexmarl_hpc.learn.sampling import SamplingParams
    tree = sampling_tree()
    tree.admit_step(0)
    (planner,) = tree.pending["planner"]
    req = tree.request(planner, 0)
    assert req[5:] == ((0.5, 0.95),) and GenRequest(*req).params(SamplingParams(0.7, 0.95)) == SamplingParams(0.5, 0.95)
    answer(tree, "planner")
    reqs = sorted(tree.request(n, 0)[5:] for n in tree.pending["solver"])
    assert reqs == [(), ((0.7, 0.9),)]
    batch = SamplingParams(0.7, 0.95)
    assert GenRequest(*tree.request(tree.pending["solver"][0], 0)[:5]).params(batch) is batch
    answer(tree, "solver")
    assert not tree.failed
    tree.close()


@pytest.mark.parametrize("bad, error", [
    ({"temperature": 0}, "ctx.chat(temperature=0): expected a number in (0, 100]"),
    ({"top_p": 1.5}, "ctx.chat(top_p=1.5): expected a number in (0, 1]"),
    ({"temperature": "hot"}, "ctx.chat(temperature='hot'): expected a number in (0, 100]")])
def test_a_bad_temperature_or_top_p_fails_the_episode_naming_it(bad, error):
    tree = sampling_tree(bad=bad)
    tree.admit_step(0)
    assert [f.error for f in tree.failed] == [f"ValueError: {error}"]
    tree.close()


def test_a_replay_goes_on_without_an_example_salvage_lost_in_a_step_an_agent_is_past():
    """Issue 38, episode workflows (tree.Tree does the same): example 0 (step 0) and example 2
    (step 1) lost whole by a salvage, the planner's checkpoint past step 0. No planner weights
    of step 0 are left to replay example 0: step 0 goes on without it (nothing pending for it,
    the solver's batch its other example's calls). Step 1 is ahead of every checkpoint:
    example 2 is replayed from the start (its planner calls pending)."""
    from flexmarl_hpc.orchestrator.tree import Node
    cfg = config(n_in=2, group=3)
    first = EpisodeTree(cfg, Task(skewed))
    for step in (0, 1):
        first.admit_step(step)
        serve(first)
    loaded = [Node(n.agent, n.turn, n.step, n.input_id, n.traj, None, [], None, prompt=list(n.prompt),
                   response=list(n.response), logprobs=list(n.logprobs), status=n.status,
                   trainer_step=n.trainer_step, row=i)
              for i, n in enumerate(first.nodes.values()) if n.input_id not in (0, 2)]
    again = EpisodeTree(cfg, Task(skewed))
    again.restore(loaded, 0, {"planner": 1, "solver": 0})
    assert again.lost_inputs == {0: {0}}
    assert {n.input_id for n in again.pending["planner"]} == {2} and not again.pending["solver"]
    kept = sum(1 for n in first.nodes.values() if n.agent == "solver" and n.input_id == 1)
    assert again.batch_of("solver", 0) == again.ready_count("solver", 0) == kept
    assert all(n.input_id != 0 for n in again.nodes.values())
    serve(again)
    assert again.batch_of("solver", 1) == first.batch_of("solver", 1)
