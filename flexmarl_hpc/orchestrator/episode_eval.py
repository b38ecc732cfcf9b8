"""Held-out evaluation of an episode workflow (run.eval_every with workflow.episode): pure
bookkeeping on the orchestrator, the twin of evaluation.Evaluator for EvalDispatch.

At every evaluation point P (0, eval_every, ..., run.steps) one episode per held-out example
(the first run.eval_inputs of workflow.dataset.eval) runs the workflow's episode function,
greedily, every agent at version P: its calls go to replicas holding version P as
evaluation batches (temperature 0, whatever a call asks), and what the episodes put in
`ctx.metrics` is averaged into /eval rows (agent "", one per metric; `analyze` draws them
in eval.png). Every agent keeps version P on the replicas until round P is over (`hold`):
an episode may call any agent until it ends.

Why it cannot change training: the episodes run on a runner of their own (their own asyncio
loop, contexts and ctx.rng: example index and episode EPISODE_BASE + P, never a training
pair), their calls never reach the experience store or the journal, and their tool calls
run in a process pool of their own on rank 0 (not the tool ranks: their answers would mix
with training's) and are not recorded in /tools.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from flexmarl_hpc.config.schema import Config
from flexmarl_hpc.orchestrator.evaluation import GREEDY, EvalResult, eval_points
from flexmarl_hpc.workflows.episode import Call

EPISODE_BASE = 1_000_000
"""Episode index of round P's episodes: EPISODE_BASE + P (training's are < group_size)."""


@dataclass(eq=False)
class EvalCall:
    """One call of an evaluation episode, as EvalDispatch sends it."""
    call: Call
    point: int
    example: int
    mode: str = GREEDY

    @property
    def agent(self) -> str:
        return self.call.agent

    @property
    def prompt(self) -> list[int]:
        return self.call.prompt

    @property
    def sample_id(self) -> str:
        return f"eval{self.point}_{self.example}_{self.call.agent}_{self.call.index}"


@dataclass
class EpisodeRound:
    point: int
    t_start: float
    running: int
    pending: dict[str, list[EvalCall]] = field(default_factory=lambda: defaultdict(list))
    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    failed: int = 0
    versions: dict[str, set] = field(default_factory=lambda: defaultdict(set))


class EpisodeEvaluator:
    def __init__(self, cfg: Config, task, done: set[int], versions: dict[str, int], runner=None):
        """`done`: points the store already has; points a restored version has passed are
        skipped. `runner`: the episodes' runner (default: the task's, with its own pool)."""
        self.cfg, self.task, self.agents = cfg, task, cfg.agent_names
        self.inputs = task.stream.heldout(cfg.run.eval_inputs)
        if runner is None:
            from flexmarl_hpc.tools.pool import WorkerPool
            from flexmarl_hpc.tools.registry import Tools
            runner = task.runner(cfg, tools=WorkerPool(Tools.from_config(cfg.tools), cfg.tools))
        self.runner = runner
        all_points = eval_points(cfg.run.steps, cfg.run.eval_every)
        self.todo = [p for p in all_points if p not in done and p >= max(versions.values())]
        self.skipped = [p for p in all_points if p not in done and p not in self.todo]
        self.rounds: dict[int, EpisodeRound] = {}
        self.results: list[EvalResult] = []
        """Rounds over since the last `take_results`."""

    # -- gating ----------------------------------------------------------------------------
    def hold(self, agent: str) -> int | None:
        """The first point not over: every agent keeps it (any episode may still call it)."""
        return self.todo[0] if self.todo else None

    def keeps(self, agent: str, version: int) -> bool:
        """`agent` may not train past `version` before a replica holds it: every point not
        yet evaluated, not only the next (with pipeline.max_staleness >= 1 an agent can
        reach a later point while the current round runs, and train past it unseen)."""
        return version in self.todo

    def finished(self) -> bool:
        return not self.todo

    def waiting(self) -> bool:
        """An evaluation episode waits on a tool or a timer: step it soon."""
        return bool(self.rounds) and self.runner.waiting()

    def start(self, versions: dict[str, int], now: float) -> None:
        """Open the next round once some agent has reached it (one round at a time: a later
        round's calls cannot be served before this one is over, and as backlog they would
        hold a time-shared replica on their agent); step the running episodes."""
        for p in self.todo[:1]:
            if p in self.rounds or p > max(versions.values()):
                continue
            self.rounds[p] = EpisodeRound(p, now, len(self.inputs))
            for i, example in enumerate(self.inputs):
                self.runner.start(p, i, EPISODE_BASE + p, example)
        self._advance(now)

    # -- requests and results ----------------------------------------------------------------
    def ready(self, agent: str, version: int) -> list[EvalCall]:
        r = self.rounds.get(version)
        return list(r.pending.get(agent, ())) if r else []

    def take(self, nodes: list[EvalCall]) -> None:
        q = self.rounds[nodes[0].point].pending[nodes[0].agent]
        sent = {id(n) for n in nodes}
        q[:] = [n for n in q if id(n) not in sent]

    def request(self, n: EvalCall) -> tuple:
        """A GenRequest without the call's own sampling: evaluation is greedy."""
        from flexmarl_hpc.learn.sampling import sample_seed  # torch: not at import (tests/unit/test_imports.py)
        return (n.sample_id, n.prompt, sample_seed(self.cfg.run.seed, n.agent, n.point, n.sample_id),
                n.call.max_tokens, 0)

    def pending_tokens(self, agent: str) -> float:
        return sum(len(n.prompt) + n.call.max_tokens for r in self.rounds.values() for n in r.pending.get(agent, ()))

    def record(self, nodes: list[EvalCall], responses: list[list[int]], version: int,
               now: float) -> list[EvalResult]:
        """Give the calls their replies, run the episodes on; returns the rounds now over."""
        r = self.rounds[nodes[0].point]
        for n, toks in zip(nodes, responses):
            r.versions[n.agent].add(version)
            n.call.done(list(toks), self.task.stop_tokens)
        self._advance(now)
        return self.take_results()

    def take_results(self) -> list[EvalResult]:
        out, self.results = self.results, []
        return out

    def _advance(self, now: float) -> None:
        while True:
            self.runner.step()
            calls, done = self.runner.take()
            self.runner.take_settled()                 # nothing is trained: a settle is a no-op here
            if not calls and not done:
                break
            for c in calls:
                ctx = c.episode
                self.rounds[ctx.step].pending[c.agent].append(EvalCall(c, ctx.step, ctx.example_id))
            for f in done:
                self._episode_over(self.rounds[f.ctx.step], f)
        for p in [p for p, r in self.rounds.items() if r.running == 0]:
            self.results.append(self._result(self.rounds.pop(p), now))
            self.todo.remove(p)

    def _episode_over(self, r: EpisodeRound, f) -> None:
        r.running -= 1
        if f.error:
            r.failed += 1
        for key, v in f.ctx.metrics.items():
            r.sums[key] += float(v)
            r.counts[key] += 1

    def _result(self, r: EpisodeRound, now: float) -> EvalResult:
        for agent, used in r.versions.items():
            assert used == {r.point}, f"eval of {agent} at {r.point} ran at versions {used}"
        metrics = {k: r.sums[k] / r.counts[k] for k in sorted(r.sums)}
        metrics["episodes_failed"] = r.failed / len(self.inputs)
        rows: dict[str, list] = defaultdict(list)
        for key, value in metrics.items():
            for col, v in (("step", r.point), ("agent", b""), ("metric", key.encode()), ("mode", GREEDY.encode()),
                           ("value", value), ("n_inputs", len(self.inputs)),
                           ("n_paths", r.counts.get(key, len(self.inputs))), ("version", r.point),
                           ("t_start", r.t_start), ("t_end", now)):
                rows[col].append(v)
        return EvalResult(r.point, dict(rows), {f"task/{k}": v for k, v in metrics.items()})

    def close(self) -> None:
        self.runner.close()
