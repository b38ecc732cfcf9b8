"""Episode functions for the end-to-end tests (imported by rank 0 of the test runs)."""
from __future__ import annotations

import asyncio
import dataclasses

from flexmarl_hpc.workflows.toolcalls import ToolRequest


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
    crashed, bonus = await on_tool_rank(ctx)
    ctx.metrics["ok"] = float(calc.output == str(example["answer"] * 2) and crashed)
    return {"solver": float(len(r.ids) % 2) + bonus}


async def with_structured_tools(ctx, example):
    """with_tools, its calculator call a structured one: the solver is asked with the
    calculator's schema (rendered by the chat template); the tiny random model never writes a
    <tool_call> block, so the call it should have made is added to its reply and run by
    ctx.run_tools, and its `tool` message is the context of the solver's second turn, which
    continues the first turn's ids verbatim (test_a_tool_using_episode_trains_exactly_the_sampled_ids).
    The prompt with the schema is ~580 tokens of the tiny model's: rollout.max_model_len 1024."""
    msgs = [{"role": "user", "content": example["question"]}]
    tools = [ctx.tool_schema("calculator")]
    r = await ctx.chat("solver", msgs, max_tokens=4, tools=tools)
    call = ToolRequest("calculator", {"expression": f"{example['answer']} * 2"}, f"solver-{r.call}-{len(r.tool_calls)}")
    results = await ctx.run_tools(dataclasses.replace(r, tool_calls=(*r.tool_calls, call)))
    r2 = await ctx.chat("solver", msgs + [r.message, *results], max_tokens=4, tools=tools)
    crashed, bonus = await on_tool_rank(ctx)
    ctx.metrics["ok"] = float(results[-1]["content"] == str(example["answer"] * 2) and crashed)
    return {"solver": [float(len(r.ids) % 2) + bonus, float(len(r2.ids) % 2) + bonus]}


async def on_tool_rank(ctx) -> tuple[bool, float]:
    """A python call, a reward function that crashes its worker and one that says where it
    ran: (the crash came back as `crashed`, 0.5 when `where` ran on a rank other than 0)."""
    py = await ctx.tool("python", "import os; print(os.environ.get('PMI_RANK', 'none'))")
    from tests.mpi.tool_fns import die, where
    crashed = await ctx.call(die, timeout_s=60)
    rank = await ctx.call(where, timeout_s=60)
    return crashed.outcome == "crashed", 0.5 * (rank.value not in (None, 0, -1)) + 0.0 * len(py.output)


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
