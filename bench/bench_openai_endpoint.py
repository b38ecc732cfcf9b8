"""The OpenAI endpoint's cost per completion (workflow.agent) against ctx.chat on the same
episode: K sequential writer turns, each a follow-up of the last (token-exact reuse on both
paths), every call answered at once by a fake engine, so what is timed is our own overhead.

    .venv/bin/python bench/bench_openai_endpoint.py [--reps 5] [--turns 8]

A: an episode function calling ctx.chat. B: the same loop as a program using the official
`openai` client against the episode's endpoint, run in the worker pool (ctx.call). The host
steps the runner as the orchestrator does: answer new calls, and while an episode waits on
a worker sleep --poll seconds (the orchestrator wakes every EPISODE_POLL_S = 20 ms when
nothing else arrives; 1 ms stands for a busy orchestrator woken by replica replies). Prints
milliseconds per completion, median [min, max] over interleaved reps after one untimed
pair, and B - A per completion.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexmarl_hpc.config.schema import WorkflowConfig
from flexmarl_hpc.config.tools import ToolsConfig
from flexmarl_hpc.tools.pool import WorkerPool
from flexmarl_hpc.tools.registry import Tools
from flexmarl_hpc.workflows.chat import Conversation, SyntheticChatTokenizer
from flexmarl_hpc.workflows.episode import EpisodeRunner
from flexmarl_hpc.workflows.openai_agent import agent_episode

TURNS = 8


async def chat_episode(ctx, example):
    messages = [{"role": "user", "content": example["question"]}]
    for _ in range(example["turns"]):
        r = await ctx.chat("writer", messages, max_tokens=4)
        messages += [{"role": "assistant", "content": r.text}, {"role": "user", "content": "Again?"}]
    return {"writer": 0.0}


def openai_program(base_url, example):
    from openai import OpenAI
    client = OpenAI(base_url=base_url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": example["question"]}]
    for _ in range(example["turns"]):
        r = client.chat.completions.create(model="writer", messages=messages, max_tokens=4)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "Again?"}]
    return {"writer": 0.0}


def episode_s(fn, pool, turns: int, poll: float) -> float:
    tok = SyntheticChatTokenizer()
    runner = EpisodeRunner(fn, ["writer"], 0, 16, lambda a: Conversation(tok), {}, tools=pool)
    reply = tok.encode("ab") + [tok.eos_id]
    t0 = time.perf_counter()
    runner.start(0, 0, 0, {"question": "2+3?", "turns": turns})
    try:
        while runner.running:
            runner.step()
            calls, done = runner.take()
            for c in calls:
                c.done(reply, frozenset(tok.stop_ids))
            if not calls and runner.waiting():
                time.sleep(poll)
        assert done and done[0].failure is None, done and done[0].failure
        return time.perf_counter() - t0
    finally:
        runner.pool = None
        runner.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--turns", type=int, default=TURNS)
    ap.add_argument("--poll", type=float, nargs="+", default=[0.02, 0.001])
    a = ap.parse_args()
    cfg = ToolsConfig(workers=1)
    pool = WorkerPool(Tools.from_config(cfg), cfg)
    # the worker imports the program by name (repo root on its path: PYTHONPATH=.)
    program = agent_episode(WorkflowConfig(agent="bench.bench_openai_endpoint:openai_program", agents=["writer"]))
    try:
        for poll in a.poll:
            runs = {"ctx.chat": [], "openai": []}
            for rep in range(a.reps + 1):              # the first pair warms the worker and imports
                for name, fn in (("ctx.chat", chat_episode), ("openai", program)):
                    t = episode_s(fn, pool, a.turns, poll) * 1e3 / a.turns
                    if rep:
                        runs[name].append(t)
            med = {k: statistics.median(v) for k, v in runs.items()}
            for k, v in runs.items():
                print(f"poll {poll * 1e3:4.0f} ms  {k:8s} {med[k]:7.2f} ms/completion [{min(v):.2f}, {max(v):.2f}]")
            print(f"poll {poll * 1e3:4.0f} ms  openai - ctx.chat: {med['openai'] - med['ctx.chat']:.2f} ms per "
                  f"completion (ratio of medians {med['openai'] / med['ctx.chat']:.1f})")
    finally:
        pool.close()


if __name__ == "__main__":
    main()
