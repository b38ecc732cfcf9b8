"""A planner, solvers and a verifier on word problems (configs/math_team.yaml).

    planner   reads the problem and decides how many solvers to ask (1-3; a reply without
              one of those digits asks 2, the middle choice)
    solver    each solves it in free text (up to workflow.max_new_tokens); it is given the
              calculator as a tool (its schema through the chat template) and may call it
              in its model's tool-call format: the calls run, and the solver is asked again
              with their results as `tool` messages in its own, growing conversation
    verifier  sees the candidate answers and names the one it believes; that is the
              team's answer (unparsable: the first solver's)

A solver's answer counts only when it is marked ("Answer: 7" or \\boxed{7}): a reply cut off
after restating the question's numbers is not right by chance. Rewards: a solver call 1
when its marked final answer is right (0.1 when marked but wrong); the verifier 1 when the team's
answer is right; the planner the team's correctness minus `extra_solver_cost` per extra
solver (workflow.episode_args; default 0.1: at 0.1 the planner of the 44-step run of
docs/episodes.md learned to always ask one, and the skew went away). Each
agent is called a different number of times per episode (1 planner, 1-3 solvers each
with 1-2 turns, 1 verifier): the skew the scheduler balances. `ctx.metrics["team_correct"]`
is what scripts/eval_heldout.py averages. `episode_args.force_calculator` prefills every solver
thread's first reply with the opening of a calculator call; `single` is one solver alone, the
baseline of scripts/team_experiment.py.
"""
from __future__ import annotations

import asyncio
import re
from dataclasses import asdict, dataclass, fields

from flexmarl_hpc.workflows.mathcheck import answer_correct, extract_answer
from flexmarl_hpc.workflows.toolcalls import PREFILL

SYSTEM = {"role": "system", "content": "You are a helpful assistant who is good at arithmetic."}


def planner_prompt(q: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": f"Problem: {q}\nHow many people should try to solve "
                     "this problem independently: 1, 2 or 3? Reply with one digit."}]


def solver_prompt(q: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": f"{q}\nYou may call the calculator. End your reply "
                     "with 'Answer: <number>'."}]


def verifier_prompt(q: str, candidates: list[str]) -> list[dict]:
    listed = "\n".join(f"- {c}" for c in candidates)
    return [SYSTEM, {"role": "user", "content": f"Problem: {q}\nProposed answers:\n{listed}\n"
                     "Which answer is correct? Reply with the number only."}]


def n_solvers(text: str) -> int:
    """The planner's first 1, 2 or 3; else 2. (With 1 as the default, SmolLM2-135M's planner,
    which mostly answers "1.1" or starts explaining, would ask one solver in every episode.)"""
    m = re.search(r"[123]", text)
    return int(m.group()) if m else 2


async def solve(ctx, q: str, force: bool = False) -> tuple[str | None, list[int]]:
    """One solver thread: its final answer and the solver call indices it used. force: its
    first reply starts with the opening of a calculator call (prefilled, out of the loss), so
    the model writes the expression: base SmolLM2-135M never starts a call by itself."""
    messages, tools = solver_prompt(q), [ctx.tool_schema("calculator")]
    prefill = PREFILL[ctx.runner.tool_formats.get("solver", "hermes")]("calculator") if force else ""
    reply = await ctx.chat("solver", messages, tools=tools, prefill=prefill)
    # what an evaluation averages per episode: the calculator calls asked for, and unreadable ones
    ctx.metrics["tool_calls"] = ctx.metrics.get("tool_calls", 0.0) + len(reply.tool_calls)
    ctx.metrics["tool_errors"] = ctx.metrics.get("tool_errors", 0.0) + len(reply.tool_errors)
    if not (reply.tool_calls or reply.tool_errors):
        return extract_answer(reply.text, require_marker=True), [reply.call]
    first = reply.call
    # the reply as sampled, then each call's result (or why it could not run) as a tool message
    messages += [reply.message, *await ctx.run_tools(reply),
                 {"role": "user", "content": "Now end with the line 'Answer: <number>'."}]
    reply = await ctx.chat("solver", messages, tools=tools, max_tokens=min(64, ctx.runner.max_new_tokens))
    return extract_answer(reply.text, require_marker=True), [first, reply.call]


async def correct(ctx, answer: str | None, gold) -> bool:
    """The answer check on a tool worker, off the orchestrator's loop (math-verify can take
    seconds on a pathological expression); a check that fails or times out counts as wrong."""
    if not answer:
        return False
    done = await ctx.call(answer_correct, answer, gold)
    return done.outcome == "ok" and bool(done.value)


@dataclass(frozen=True)
class MathTeamArgs:
    """workflow.episode_args this episode reads, with their defaults."""
    extra_solver_cost: float = 0.1
    """The planner's charge per solver beyond the first, in [0, 1]."""
    force_calculator: bool = False
    """Every solver thread's first reply is a calculator call (its opening prefilled)."""

    def __post_init__(self):
        cost = self.extra_solver_cost
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0 <= cost <= 1:
            raise ValueError(f"workflow.episode_args.extra_solver_cost: expected a number in [0, 1], got {cost!r}")
        if not isinstance(self.force_calculator, bool):
            raise ValueError("workflow.episode_args.force_calculator: expected true or false, "
                             f"got {self.force_calculator!r}")


ARGS = MathTeamArgs
"""The episode_args declaration the launcher checks before any rank starts (episode_check.py)."""


def episode_args(args: dict) -> dict:
    """ARGS overridden by workflow.episode_args; an unknown key or a bad value is refused by name."""
    known = sorted(f.name for f in fields(ARGS))
    bad = sorted(set(args) - set(known))
    if bad:
        raise ValueError(f"workflow.episode_args: unknown {bad}, expected some of {known}")
    return asdict(ARGS(**args))


async def episode(ctx, example: dict) -> dict:
    q, gold = example["question"], example["answer"]
    args = episode_args(ctx.args)
    cost = args["extra_solver_cost"]
    plan = await ctx.chat("planner", planner_prompt(q), max_tokens=4)
    k = n_solvers(plan.text)
    results = await asyncio.gather(*(solve(ctx, q, args["force_calculator"]) for _ in range(k)))
    answers = [a for a, _ in results]
    candidates = list(dict.fromkeys(a for a in answers if a is not None)) or ["none"]
    pick = await ctx.chat("verifier", verifier_prompt(q, candidates), max_tokens=8)
    chosen = extract_answer(pick.text)
    team = chosen if chosen in candidates else (answers[0] or "")
    verdicts = dict(zip(candidates, await asyncio.gather(*(correct(ctx, a, gold) for a in candidates))))
    team_ok = float(verdicts[team] if team in verdicts else await correct(ctx, team, gold))
    ctx.metrics["team_correct"] = team_ok
    ctx.metrics["solvers"] = float(k)
    solver_rewards = [0.0] * sum(len(calls) for _, calls in results)
    for a, calls in results:
        for i in calls:        # right: 1; a marked answer that is wrong: 0.1 (the format is half the way)
            solver_rewards[i] = 1.0 if a is not None and verdicts[a] else 0.1 * (a is not None)
    return {"planner": team_ok - cost * (k - 1), "solver": solver_rewards, "verifier": team_ok}


async def single(ctx, example: dict) -> dict:
    """One solver alone (workflow.agents: [solver]): the baseline the team is compared with
    (scripts/team_experiment.py). Same prompt, calculator and rewards as a team solver;
    `team_correct` is its own marked answer's correctness, so one evaluation scores both."""
    args = episode_args(ctx.args)
    answer, calls = await solve(ctx, example["question"], args["force_calculator"])
    ok = await correct(ctx, answer, example["answer"])
    ctx.metrics["team_correct"] = float(ok)
    ctx.metrics["solvers"] = 1.0
    return {"solver": [1.0 if ok else 0.1 * (answer is not None)] * len(calls)}
