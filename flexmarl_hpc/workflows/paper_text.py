"""The paper's MA and CA tasks as a text episode (configs/paper_*.yaml), with the paper's lengths.

    workflow:
      episode: flexmarl_hpc.workflows.paper_text:episode
      agents: [shop32_0, shop14_0, ...]          # the chain, in order
      episode_args: {prompt_tokens: 1024, context_carried: 0.5, length_median: 1024, ...}

Each episode is the relay chain of sim/workload.py: every agent in `chain` (default: the
workflow's agents) answers in turn; its prompt is a query of `prompt_tokens` filler tokens plus
`context_carried` of each earlier reply, so later agents see longer prompts. An agent may be
called again in its own growing conversation: `calls: {agent: [lo, hi]}` (default [1, 1], the
relay) draws how many times per episode. Each call asks for a reply length drawn from the
agent's lognormal (median: `length_median` skewed per agent by `agent_skew`, seeded; sigma
`length_sigma`; at most `max_tokens` and workflow.max_new_tokens): with the simulator's
synthetic workers a reply is exactly that long (filler letters), so the lengths the episode
asks for are the lengths priced. With a real policy they are caps.

With `settle: true` each agent's reward is given as soon as its last call of the episode is in
(ctx.settle: a per-agent rule reward on its own reply), so its calls can train while the later
agents of the chain still run (the default); with false every reward comes at the episode's end.

The control flow never reads reply text (synthetic text is filler): the call counts and lengths
come from `ctx.rng`, seeded by run, example and episode, so a replay repeats them. Rewards are
random (a coin per agent per episode): the paper's e-commerce rewards are not public and the
simulator prices no learning. The numbers, their sources and the unknowns: sim/workload.py.
The synthetic tokenizer (no checkpoint) is byte-level: one filler character is one token.
"""
from __future__ import annotations

import math

import numpy as np

DEFAULTS = {"prompt_tokens": 1024, "context_carried": 0.1, "length_median": 1024.0, "length_sigma": 0.8,
            "agent_skew": 0.5, "max_tokens": 8192, "seed": 0, "settle": True}
"""The workload's one copy of its defaults: the paper configs' episodes (configs/paper_*.yaml,
which set none of them) and `simulate paper`'s tasks (sim.workload.TaskSpec's fields default
to these) run the same job. Sources, per field, in TaskSpec: max_tokens is the paper's 8,192;
the rest are unknowns with a sweep. context_carried 0.1 keeps a 15-agent chain's last prompt
(1,024 + 14 x 0.1 x ~1,400 mean tokens) inside the 8,192-token context (0.5 overflowed it);
settle true: the paper's micro-batch pipeline trains a micro-batch as soon as its samples are
in, which presumes per-agent rewards (false: every reward at the episode's end; until
2026-11-29 the configs had false and `simulate paper` true, issue 37)."""
WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor ".split()


def agent_medians(agents: list[str], median: float, skew: float, seed: int) -> dict[str, float]:
    """Each agent's median reply length: a seeded lognormal skew around `median` (the paper's
    "skewed inter-agent request patterns"); sim.workload.TaskSpec.medians is this."""
    z = np.random.default_rng([seed, 0xA6]).standard_normal(len(agents))
    return {a: float(median * math.exp(skew * x)) for a, x in zip(agents, z)}


def filler(n: int, offset: int = 0) -> str:
    """`n` characters of words (n tokens of the synthetic byte-level tokenizer)."""
    text = " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(n // 4 + len(WORDS)))
    while len(text) < n:
        text += " " + text
    return text[:n]


def args_of(ctx) -> dict:
    """episode_args over DEFAULTS; a key that is not one is refused by name."""
    known = {*DEFAULTS, "chain", "calls"}
    bad = sorted(set(ctx.args) - known)
    if bad:
        raise ValueError(f"workflow.episode_args: unknown {bad}, expected some of {sorted(known)}")
    return {**DEFAULTS, **ctx.args}


def call_counts(ctx, chain: list[str], calls: dict) -> dict[str, int]:
    """How many times each agent of the chain is called in this episode (drawn from ctx.rng)."""
    out = {}
    for agent in chain:
        lo, hi = calls.get(agent, (1, 1))
        if not 1 <= int(lo) <= int(hi):
            raise ValueError(f"workflow.episode_args.calls.{agent}: expected [lo, hi] with 1 <= lo <= hi, "
                             f"got {[lo, hi]}")
        out[agent] = int(ctx.rng.integers(int(lo), int(hi) + 1))
    return out


async def episode(ctx, example: dict) -> dict:
    a = args_of(ctx)
    chain = list(a.get("chain") or ctx.runner.agents)
    medians = agent_medians(chain, float(a["length_median"]), float(a["agent_skew"]), int(a["seed"]))
    counts = call_counts(ctx, chain, dict(a.get("calls") or {}))
    cap = min(int(a["max_tokens"]), ctx.runner.max_new_tokens)
    query = f"query {example.get('id', '')}: " + filler(int(a["prompt_tokens"]), int(example.get("id", 0)))
    carried = ""
    for agent in chain:
        messages = [{"role": "user", "content": query + carried}]
        for k in range(counts[agent]):
            n = int(round(ctx.rng.lognormal(math.log(medians[agent]), float(a["length_sigma"]))))
            reply = await ctx.chat(agent, messages, max_tokens=max(1, min(n, cap)))
            messages += [{"role": "assistant", "content": reply.text}]
            if k + 1 < counts[agent]:
                messages += [{"role": "user", "content": "continue"}]
            carried += " " + reply.text[:int(float(a["context_carried"]) * len(reply.text))]
        if a["settle"]:
            ctx.settle(agent, float(ctx.rng.random() < 0.5))
    return {agent: float(ctx.rng.random() < 0.5) for agent in chain if agent not in ctx.settled}
