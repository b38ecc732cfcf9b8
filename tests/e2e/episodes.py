"""Episode functions for the end-to-end tests (imported by rank 0 of the test runs)."""
from __future__ import annotations

import asyncio


async def skewed(ctx, example):
    """A planner, then 1-3 solvers in parallel (drawn from ctx.rng: the skew), each with a
    second turn in its own conversation half of the time, a calculator call, and a judge."""
    q = example["question"]
    await ctx.chat("planner", [{"role": "user", "content": f"Plan: {q}"}], max_tokens=4)
    k = int(ctx.rng.integers(1, 4))

    async def solve(j):
        msgs = [{"role": "user", "content": f"Solve {j}: {q}"}]
        r = await ctx.chat("solver", msgs)
        calls = [r.call]
        if ctx.rng.random() < 0.5:
            calc = await ctx.tool("calculator", f"{example['answer']} + {j}")
            msgs += [{"role": "assistant", "content": r.text}, {"role": "user", "content": calc.output}]
            calls.append((await ctx.chat("solver", msgs, max_tokens=4)).call)
        return calls

    threads = await asyncio.gather(*(solve(j) for j in range(k)))
    judge = await ctx.chat("judge", [{"role": "user", "content": f"Judge: {q}"}], max_tokens=2)
    rewards = [0.0] * sum(map(len, threads))
    for calls in threads:
        for i in calls:
            rewards[i] = float(len(calls) == 2)
    ctx.metrics["k"] = float(k)
    return {"planner": float(k == 2), "solver": rewards, "judge": float(len(judge.ids) % 2)}


async def judge_on_even(ctx, example):
    """The judge is called only for even examples: with one example per step, every other
    step has no judge call at all (an empty step for its trainer)."""
    await ctx.chat("planner", [{"role": "user", "content": example["question"]}], max_tokens=4)
    if ctx.example_id % 2 == 0:
        await ctx.chat("judge", [{"role": "user", "content": "judge"}], max_tokens=2)
        return {"planner": float(ctx.episode), "judge": 1.0}
    return {"planner": float(ctx.episode)}


async def with_tools(ctx, example):
    """A solver, then a calculator call, a python call and a reward function that crashes
    its worker (tests/mpi/tool_fns.py): run on a tool rank with tools.ranks > 0."""
    r = await ctx.chat("solver", [{"role": "user", "content": example["question"]}], max_tokens=4)
    calc = await ctx.tool("calculator", f"{example['answer']} * 2")
    py = await ctx.tool("python", "import os; print(os.environ.get('PMI_RANK', 'none'))")
    from tests.mpi.tool_fns import die, where
    crashed = await ctx.call(die, timeout_s=60)
    rank = await ctx.call(where, timeout_s=60)
    ctx.metrics["ok"] = float(calc.output == str(example["answer"] * 2) and crashed.outcome == "crashed")
    return {"solver": float(len(r.ids) % 2) + 0.5 * (rank.value not in (None, 0, -1)) + 0.0 * len(py.output)}


async def fails_always(ctx, example):
    """Every episode asks an agent that is not in workflow.agents (test_episode_failures_e2e)."""
    await ctx.chat("critic", [{"role": "user", "content": example["question"]}], max_tokens=2)
    return {"planner": 1.0}


async def fails_one_in_ten(ctx, example):
    """Episode 0 of every fifth example reads a key the example lacks, after its planner call:
    one episode in ten with group_size 2 (test_episode_failures_e2e)."""
    r = await ctx.chat("planner", [{"role": "user", "content": example["question"]}], max_tokens=4)
    if ctx.example_id % 5 == 0 and ctx.episode == 0:
        return {"planner": example["no_such_key"]}
    return {"planner": float(len(r.ids) % 2)}


async def slow_tools(ctx, example):
    """A solver, then a sandboxed python call and a reward function that take half a minute
    each: the tool rank's sandbox launcher and reward worker are mid-call when
    test_a_killed_tool_rank_leaves_no_process_behind kills that rank."""
    r = await ctx.chat("solver", [{"role": "user", "content": example["question"]}], max_tokens=4)
    from tests.mpi.tool_fns import sleepy
    await asyncio.gather(ctx.tool("python", "import time; time.sleep(30)"), ctx.call(sleepy, 30, timeout_s=60))
    return {"solver": float(len(r.ids) % 2)}
