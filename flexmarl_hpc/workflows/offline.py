"""Episodes run in one process against in-process models: evaluation of checkpoints
(scripts/eval_heldout.py) and quick checks of an episode function, with the very runner a
training run uses (workflows/episode.py) and the same sampler as the torch replicas.

    results = run_episodes(task, cfg, models, examples, GREEDY)
    accuracy = sum(r.ctx.metrics["team_correct"] for r in results) / len(results)
"""
from __future__ import annotations

import time
from collections import defaultdict

from flexmarl_hpc.learn.sampling import SamplingParams, generate, sample_seed
from flexmarl_hpc.workflows.episode import Finished

GREEDY = SamplingParams(temperature=1.0, top_p=1e-9)     # top_p keeps only the top token


def run_episodes(task, cfg, models: dict, examples: list[dict], params: SamplingParams = GREEDY,
                 batch: int = 64, tools=None, seed: int = 0) -> list[Finished]:
    """Run one episode per example to its end; returns them in example order. `models`:
    agent -> CausalLM; `tools`: a tools.pool.WorkerPool for episodes that call tools."""
    runner = task.runner(cfg, tools=tools)
    for i, example in enumerate(examples):
        runner.start(0, i, 0, example)
    done: list[Finished] = []
    try:
        while True:
            runner.step()
            calls, finished = runner.take()
            done += finished
            if calls:
                _answer(task, models, calls, params, batch, seed)
            elif runner.waiting():
                time.sleep(0.005)                  # a tool call in flight
            elif runner.running:
                raise RuntimeError(f"{runner.running} episodes wait on something that never comes")
            else:
                break
    finally:
        runner.close()
    return sorted(done, key=lambda f: f.ctx.example_id)


def _answer(task, models: dict, calls: list, params: SamplingParams, batch: int, seed: int) -> None:
    by_agent = defaultdict(list)
    for c in calls:
        by_agent[c.agent].append(c)
    for agent, cs in by_agent.items():
        for i in range(0, len(cs), batch):
            chunk = cs[i:i + batch]
            seeds = [sample_seed(seed, agent, 0, f"{c.episode.example_id}_{c.index}_{c.episode.episode}")
                     for c in chunk]
            gens = generate(models[agent], [c.prompt for c in chunk], seeds, [c.max_tokens for c in chunk],
                            params, task.vocab.pad_id, task.stop_tokens, [None] * len(chunk))
            for c, g in zip(chunk, gens):
                c.done(list(g.tokens), task.stop_tokens)
