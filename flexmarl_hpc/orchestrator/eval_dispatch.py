"""Held-out evaluation on the orchestrator's loop: `EvalDispatch` sends an `Evaluator`'s
requests to the replicas and writes its finished rounds; `NoEvaluation` (run.eval_every 0)
has the same interface and does nothing, so the loop never asks whether there is one:

    evals = eval_dispatch(cfg, task, store, versions, clock, sinks)
    lines = evals.start(versions, store.now())       # each round of the loop (rounds now over)
    evals.dispatch(agent, replicas, binding, new_batch_id, send)
    if evals.owns(msg.batch_id):
        rank, lines = evals.generated(msg.batch_id, msg.outputs)

Evaluation batches go to replicas holding the evaluated version; their answers never
reach the experience store. Fixed-turn workflows are evaluated by evaluation.Evaluator,
episode workflows by episode_eval.EpisodeEvaluator (same interface).
"""
from __future__ import annotations

from typing import Callable

from flexmarl_hpc.config.schema import Config
from flexmarl_hpc.orchestrator.evaluation import GREEDY, Evaluator, sink_scalars
from flexmarl_hpc.orchestrator.sinks import Sinks
from flexmarl_hpc.runtime import messages
from flexmarl_hpc.runtime.timing import BusyClock
from flexmarl_hpc.store.tables import StoreFile
from flexmarl_hpc.workflows.base import Task


class NoEvaluation:
    """run.eval_every 0: nothing to hold, dispatch or wait for."""

    def __init__(self) -> None:
        self.skipped: list[int] = []
        self.batches: dict[int, tuple] = {}

    def finished(self) -> bool:
        return True

    def start(self, versions: dict[str, int], now: float) -> list[str]:
        return []

    def waiting(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pending_tokens(self, agent: str) -> int:
        return 0

    def hold(self, agent: str) -> int | None:
        return None

    def keeps(self, agent: str, version: int) -> bool:
        return False

    def dispatch(self, agent: str, replicas: list, binding: list[str], new_batch_id: Callable[[], int],
                 send: Callable[[int, messages.Command, str], None]) -> None:
        pass

    def owns(self, batch_id: int) -> bool:
        return False


class EvalDispatch:
    def __init__(self, cfg: Config, evaluator: Evaluator, store: StoreFile, clock: BusyClock,
                 sinks: Sinks) -> None:
        self.cfg, self.evaluator, self.store, self.clock, self.sinks = cfg, evaluator, store, clock, sinks
        self.batches: dict[int, tuple[int, str, int, list]] = {}     # id -> rank, agent, version, nodes
        self.skipped = evaluator.skipped
        self.finished = evaluator.finished
        self.pending_tokens, self.hold, self.keeps = evaluator.pending_tokens, evaluator.hold, evaluator.keeps

    def start(self, versions: dict[str, int], now: float) -> list[str]:
        """Open the rounds some agent has reached; the log lines of rounds that ended
        meanwhile (an episode round can end between replies, after a tool call)."""
        self.evaluator.start(versions, now)
        return self._write(self.evaluator.take_results())

    def waiting(self) -> bool:
        """Evaluation episodes wait on a tool: the loop must come back soon."""
        return self.evaluator.waiting()

    def close(self) -> None:
        self.evaluator.close()

    def owns(self, batch_id: int) -> bool:
        return batch_id in self.batches

    def dispatch(self, agent: str, replicas: list, binding: list[str], new_batch_id: Callable[[], int],
                 send: Callable[[int, messages.Command, str], None]) -> None:
        """Send `agent`'s pending evaluation requests to idle replicas holding the version
        they evaluate (its bound replicas first: another agent's replica may switch engines)."""
        idle = sorted((r for r in replicas if r.busy is None and r.held.get(agent) is not None),
                      key=lambda r: binding[r.rank - 1] != agent)
        ro = self.cfg.rollout
        for r in idle:
            version = r.held[agent]
            nodes = self.evaluator.ready(agent, version)[: ro.max_batch]
            if not nodes:
                continue
            self.evaluator.take(nodes)
            from flexmarl_hpc.learn.sampling import SamplingParams  # torch: not at import (tests/unit/test_imports.py)
            params = SamplingParams(0.0 if nodes[0].mode == GREEDY else ro.temperature, ro.top_p)
            bid = new_batch_id()
            self.batches[bid] = (r.rank, agent, version, nodes)
            send(r.rank, messages.Generate(bid, agent, version, [self.evaluator.request(n) for n in nodes], params),
                 f"evaluation batch {bid} of agent {agent} v{version} ({len(nodes)} requests)")
            r.busy, r.outstanding = "gen", float(sum(len(n.prompt) for n in nodes))

    def generated(self, batch_id: int, outputs: list) -> tuple[int, list[str]]:
        """Evaluation answers: never journalled; a finished round becomes /eval rows, sink
        scalars and a log line. Returns the replica's rank and the log lines."""
        rank, agent, version, nodes = self.batches.pop(batch_id)
        return rank, self._write(self.evaluator.record(nodes, [t for t, _ in outputs], version, self.store.now()))

    def _write(self, results) -> list[str]:
        """Finished rounds -> /eval rows, sink scalars and log lines."""
        lines = []
        for res in results:
            with self.clock("store"):
                self.store.append_eval(res.rows)
                self.store.flush()
            written = self.store.eval.read(self.store.eval.disk - len(res.rows["step"]))
            self.sinks.write(res.point, sink_scalars(written)[res.point])     # as the store has them
            secs = res.rows["t_end"][0] - res.rows["t_start"][0]
            lines.append(f"eval at step {res.point:4d} | " + " ".join(f"{k} {v:.3f}" for k, v in res.summary.items())
                         + f" | {res.rows['n_inputs'][0]} held-out inputs, {secs:.1f} s")
        return lines


def eval_dispatch(cfg: Config, task: Task, store: StoreFile, versions: dict[str, int], clock: BusyClock,
                  sinks: Sinks) -> EvalDispatch | NoEvaluation:
    """run.eval_every > 0: an EvalDispatch that skips the points the store already has."""
    if not cfg.run.eval_every:
        return NoEvaluation()
    done = set(store.eval.read()["step"].tolist())
    if cfg.workflow.episode:
        from flexmarl_hpc.orchestrator.episode_eval import EpisodeEvaluator
        return EvalDispatch(cfg, EpisodeEvaluator(cfg, task, done, versions), store, clock, sinks)
    return EvalDispatch(cfg, Evaluator(cfg, task, done, versions), store, clock, sinks)
