"""Held-out evaluation (run.eval_every): pure bookkeeping on the orchestrator, no I/O.

At every evaluation point P (0, eval_every, 2 x eval_every, ..., and run.steps) each
agent is evaluated at exactly version P: the task's `heldout_inputs(run.eval_inputs)` go
down the workflow's turns, one greedy response per turn (mode `greedy`), plus
`run.eval_samples` chains per input sampled at rollout.temperature (mode `sample`), on
the same replicas and engines as training. `Task.eval_metrics` of every finished path is
averaged into one row per (agent, metric, mode) of /eval.

Why it cannot disturb training: its nodes live here, never in the training trees or the
journal; inputs come from `heldout_inputs` (no rng), seeds from the sample's own identity
(sampling.sample_seed with an `eval...` sample id), so the training inputs and sampling
streams are the same with and without it. The orchestrator keeps version P of an agent on
the replicas until that agent's part of round P is generated (`hold`), which can delay
training, never change it.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from flexmarl_hpc.config.schema import Config
from flexmarl_hpc.store.schema import eval_key
from flexmarl_hpc.workflows.base import Path, Task

GREEDY, SAMPLE = "greedy", "sample"


@dataclass(eq=False)
class EvalNode:
    point: int
    turn: int
    agent: str
    mode: str
    chain: int                         # input index x chains per input + sample index
    root_input: object
    parent: "EvalNode | None"
    prompt: list[int] = field(default_factory=list)
    response: list[int] | None = None

    @property
    def sample_id(self) -> str:
        # never a training sample id ({input_id}_{turn}_{traj}): its seed differs too
        return f"eval{self.point}_{self.mode}_{self.chain}_{self.turn}"

    def path(self) -> Path:
        return Path.to(self)


@dataclass
class Round:
    """One evaluation point in flight."""
    point: int
    t_start: float
    left: dict[str, int]                                   # agent -> nodes not yet generated
    pending: dict[str, list[EvalNode]] = field(default_factory=lambda: defaultdict(list))
    sums: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    paths: dict[str, int] = field(default_factory=lambda: defaultdict(int))   # mode -> finished
    versions: dict[str, set] = field(default_factory=lambda: defaultdict(set))


@dataclass
class EvalResult:
    point: int
    rows: dict[str, list]              # /eval columns
    summary: dict[str, float]          # "agent/metric[/sample]" -> value (log line, sinks)


def sink_scalars(rows) -> dict[int, dict[str, float]]:
    """{step: {"<agent>/eval/<metric>[/sample]": value}} of /eval rows (a record array)."""
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for r in rows:
        key = eval_key(r["agent"].decode(), r["metric"].decode(), r["mode"].decode())
        out[int(r["step"])][key.replace("/", "/eval/", 1)] = float(r["value"])
    return dict(out)


def eval_points(steps: int, every: int) -> list[int]:
    """The versions evaluated: 0 (before training), every `every` steps, and the last."""
    return sorted(set(range(0, steps + 1, every)) | {steps}) if every > 0 else []


class Evaluator:
    def __init__(self, cfg: Config, task: Task, done: set[int], versions: dict[str, int]):
        """`done`: points the store already has; points an agent's restored version has
        passed cannot be evaluated any more (those weights are gone) and are skipped."""
        self.cfg, self.task = cfg, task
        self.turns = cfg.workflow.turns
        self.agents = cfg.agent_names
        run = cfg.run
        self.inputs = task.heldout_inputs(run.eval_inputs)
        self.modes = [(GREEDY, 1)] + ([(SAMPLE, run.eval_samples)] if run.eval_samples else [])
        all_points = eval_points(run.steps, run.eval_every)
        self.todo = [p for p in all_points if p not in done and p >= max(versions.values())]
        self.skipped = [p for p in all_points if p not in done and p not in self.todo]
        self.rounds: dict[int, Round] = {}
        per_agent = {agent: sum(t.agent == agent for t in self.turns) for agent in self.agents}
        chains = sum(k for _, k in self.modes) * len(self.inputs)
        self.size = {agent: chains * per_agent[agent] for agent in self.agents}

    # -- gating ----------------------------------------------------------------------------
    def hold(self, agent: str) -> int | None:
        """The version `agent` must keep on the replicas (its part of that round is not
        generated yet), or None: a newer version may not be pushed before it is served."""
        for p in self.todo:
            r = self.rounds.get(p)
            if r is None or r.left[agent] > 0:
                return p
        return None

    def keeps(self, agent: str, version: int) -> bool:
        """`agent` may not train past `version` before a replica holds it (it is evaluated)."""
        return self.hold(agent) == version

    def finished(self) -> bool:
        return not self.todo

    def start(self, versions: dict[str, int], now: float) -> None:
        """Open the rounds some agent has reached (their first turns can be served)."""
        for p in self.todo:
            if p in self.rounds or p > max(versions.values()):
                continue
            r = self.rounds[p] = Round(p, now, dict(self.size))
            for mode, k in self.modes:
                for i, x in enumerate(self.inputs):
                    for j in range(k):
                        self._spawn(r, mode, i * k + j, x, None)

    def _spawn(self, r: Round, mode: str, chain: int, x, parent: EvalNode | None) -> None:
        t = 0 if parent is None else parent.turn + 1
        node = EvalNode(r.point, t, self.turns[t].agent, mode, chain, x, parent)
        node.prompt = self.task.prompt(t, node.path())
        r.pending[node.agent].append(node)

    # -- requests and results ----------------------------------------------------------------
    def ready(self, agent: str, version: int) -> list[EvalNode]:
        """Pending nodes of `agent` at `version` (of one mode: a batch has one temperature)."""
        r = self.rounds.get(version)
        q = r.pending.get(agent) if r else None
        if not q:
            return []
        mode = q[0].mode
        return [n for n in q if n.mode == mode]

    def take(self, nodes: list[EvalNode]) -> None:
        q = self.rounds[nodes[0].point].pending[nodes[0].agent]
        sent = {id(n) for n in nodes}
        q[:] = [n for n in q if id(n) not in sent]

    def request(self, n: EvalNode) -> tuple:
        """(sample_id, prompt, seed, max_new_tokens, turn): a replica's GenRequest."""
        budget = self.task.response_budget(n.turn, n.sample_id, self.turns[n.turn].max_new_tokens)
        from flexmarl_hpc.learn.sampling import sample_seed  # torch: not at import (tests/unit/test_imports.py)
        return (n.sample_id, n.prompt, sample_seed(self.cfg.run.seed, n.agent, n.point, n.sample_id),
                budget, n.turn)

    def take_results(self) -> list[EvalResult]:
        """Rounds that ended between replies: none here (a round ends in `record`; an episode
        round can end after a tool call, episode_eval.py)."""
        return []

    def waiting(self) -> bool:
        return False                     # no tool calls: nothing runs between replies

    def close(self) -> None:
        pass

    def pending_tokens(self, agent: str) -> float:
        return sum(len(n.prompt) + self.turns[n.turn].max_new_tokens
                   for r in self.rounds.values() for n in r.pending.get(agent, ()))

    def record(self, nodes: list[EvalNode], responses: list[list[int]], version: int,
               now: float) -> list[EvalResult]:
        """Set the responses, grow the chains, score finished paths; returns finished rounds."""
        r = self.rounds[nodes[0].point]
        for n, toks in zip(nodes, responses):
            n.response = list(toks)
            r.left[n.agent] -= 1
            r.versions[n.agent].add(version)
            if n.turn + 1 < len(self.turns):
                self._spawn(r, n.mode, n.chain, n.root_input, n)
                continue
            path = n.path()
            path = Path(path.input, path.responses + (tuple(n.response),))
            for key, v in self.task.eval_metrics(path).items():
                r.sums[(n.mode, key)] += float(v)
            r.paths[n.mode] += 1
        if any(r.left.values()):
            return []
        del self.rounds[r.point]
        self.todo.remove(r.point)
        return [self._result(r, now)]

    def _result(self, r: Round, now: float) -> EvalResult:
        rows: dict[str, list] = defaultdict(list)
        summary = {}
        order = {agent: i for i, agent in enumerate(self.agents)}
        keyed = sorted(((mode != GREEDY, order.get(self._split(key)[0], len(order)), key), (mode, key, total))
                       for (mode, key), total in r.sums.items())       # workflow order, greedy first
        for _, (mode, key, total) in keyed:
            agent, metric = self._split(key)
            value = total / r.paths[mode]
            used = r.versions.get(agent, {r.point})
            assert used == {r.point}, f"eval of {agent} at {r.point} ran at versions {used}"
            for col, v in (("step", r.point), ("agent", agent.encode()), ("metric", metric.encode()),
                           ("mode", mode.encode()), ("value", value), ("n_inputs", len(self.inputs)),
                           ("n_paths", r.paths[mode]), ("version", r.point), ("t_start", r.t_start),
                           ("t_end", now)):
                rows[col].append(v)
            summary[eval_key(agent, metric, mode)] = value
        return EvalResult(r.point, dict(rows), summary)

    def _split(self, key: str) -> tuple[str, str]:
        """Metric key -> (agent or "", metric): see workflows/base.py."""
        if key in self.agents:
            return key, "reward"
        agent, _, name = key.partition("/")
        return (agent, name) if name and agent in self.agents else ("", key)
