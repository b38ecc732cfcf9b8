"""What the orchestrator writes about a run, apart from the samples: every rank's busy
intervals, the /steps rows of finished steps, the /metrics rows and log lines of finished
global steps and the run.loggers sinks (when a checkpoint is due: checkpoint_timer.py).

    rec = RunRecorder(cfg, layout, store, clock, first_step, forget_step=exp.forget_step)
    rec.record_intervals(src, msg.intervals)         # each reply
    rec.step_finished(agent, version, stats, nodes, n_micro)
    finished = rec.record_steps()                    # after schedule(): /steps rows, (agent, version)
    for line in rec.log_steps(done): log(line)       # every global step all agents finished

The HDF5 store stays the source of truth: the sinks read the steps' rows back from it. Its
clock is the orchestrator's (`clock.source`, the run's flexmarl_hpc.clock.Clock: simulated
in a simulation), as is the store's.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

import numpy as np

from flexmarl_hpc.config.layout import RankLayout
from flexmarl_hpc.config.schema import Config
from flexmarl_hpc.orchestrator.evaluation import sink_scalars
from flexmarl_hpc.orchestrator.sinks import open_sinks, step_scalars
from flexmarl_hpc.runtime.timing import BusyClock
from flexmarl_hpc.store.tables import StoreFile


class RunRecorder:
    def __init__(self, cfg: Config, layout: RankLayout, store: StoreFile, clock: BusyClock,
                 first_step: int, forget_step: Callable[[int], None] = lambda step: None) -> None:
        self.cfg, self.layout, self.store, self.clock = cfg, layout, store, clock
        self.forget_step = forget_step           # a logged step's in-memory samples can go
        self.agents = cfg.agent_names
        self.logged_step = first_step
        self.sinks = open_sinks(cfg, store, first_step)     # run.loggers; HDF5 stays the source
        self.iv_rows: dict[str, list] = defaultdict(list)   # intervals not yet in the store
        self.window = defaultdict(float)    # busy seconds by activity since the last log line
        self.time = clock.source.time         # the run's clock: wall seconds of the log lines
        self.t_last = self.time()
        self.samples_since = 0
        self.tokens_since = 0
        self.step_summary: dict[tuple, object] = {}     # per (agent, step): reward, staleness
        self.tis: dict[tuple, float] = {}               # per (agent, step): mean importance weight
        self.stepped: list[tuple] = []                  # finished steps not yet in /steps

    # -- intervals -------------------------------------------------------------------------
    def record_intervals(self, src: int, intervals: list, count: bool = True) -> None:
        """Buffer a rank's intervals; they reach the store once a logged step (one append)."""
        if not intervals:
            return
        role, _ = self.layout.role_of(src)
        if count:
            for act, _, t0, t1 in intervals:
                if act != "wait":
                    self.window[act] += t1 - t0
        t0, k, rows = self.store.t0, len(intervals), self.iv_rows
        rows["rank"] += [src] * k
        rows["role"] += [role.encode()] * k
        rows["activity"] += [i[0].encode() for i in intervals]
        rows["agent"] += [i[1].encode() for i in intervals]
        rows["t0"] += [i[2] - t0 for i in intervals]
        rows["t1"] += [i[3] - t0 for i in intervals]

    def write_intervals(self) -> None:
        """The orchestrator's own intervals and every rank's buffered ones, in one append."""
        with self.clock("store"):
            self.record_intervals(0, self.clock.drain(), count=False)
            if self.iv_rows:
                self.store.intervals.append(dict(self.iv_rows))
                self.iv_rows.clear()

    def flush(self) -> None:
        """Every interval buffered so far into the store, and the store committed."""
        self.write_intervals()
        self.store.flush()

    # -- steps -----------------------------------------------------------------------------
    def step_finished(self, agent: str, version: int, stats: dict, nodes: list, n_micro: int) -> None:
        """An agent's optimizer step `version - 1` is done: remember its summary and row."""
        step = version - 1
        stale = np.array([step - nd.version for nd in nodes])
        # an empty step (episode workflows: no episode of it called the agent) has no reward
        reward = float(np.mean([nd.reward for nd in nodes])) if nodes else float("nan")
        self.step_summary[(agent, step)] = (reward, int(stale.max(initial=0)))
        # mean truncated importance weight of the step's samples (trainer stats are sums
        # over samples); the log shows it when pipeline.max_staleness > 0
        tis = self.tis[(agent, step)] = stats.get("tis_mean", np.nan) / max(len(nodes), 1)
        self.stepped.append((agent, version, stats, nodes, reward, stale, tis, n_micro))
        self.samples_since += len(nodes)

    def record_steps(self) -> list[tuple[str, int]]:
        """The /steps rows of the steps finished since the last call; returns those steps as
        (agent, version)."""
        if not self.stepped:
            return []
        done, self.stepped = self.stepped, []
        with self.clock("store"):
            for args in done:
                self.append_step(*args)
            # written now, committed by the next flush: checkpoint() commits before it sends
            self.store.flush(full=False)
        return [(agent, version) for agent, version, *_ in done]

    def append_step(self, agent: str, version: int, stats: dict, nodes: list, reward: float,
                    stale: np.ndarray, tis: float, n_micro: int) -> None:
        step, n = version - 1, max(len(nodes), 1)
        off = self.store.step_rows[agent].append(np.array([nd.row for nd in nodes], dtype=np.int64))
        self.store.steps[agent].append({"step": [step], "version": [version], "t_end": [self.store.now()],
                    "n_samples": [len(nodes)], "n_micro": [n_micro],
                    "loss": [stats.get("loss", 0) / n], "reward_mean": [reward],
                    "entropy": [stats.get("entropy", 0) / n], "kl": [stats.get("kl", 0) / n],
                    "logp_mismatch": [stats.get("logp_mismatch", np.nan) / n],
                    "tis_mean": [tis], "clip_frac": [stats.get("clip_frac", np.nan) / n],
                    "ppo_kl": [stats.get("ppo_kl", np.nan) / n],
                    "grad_norm": [stats.get("grad_norm", 0)], "staleness_max": [stale.max(initial=0)],
                    "staleness_mean": [stale.mean() if stale.size else 0.0],
                    "rows_offset": [off], "rows_len": [len(nodes)]})

    # -- global steps: /metrics, sinks, log lines ------------------------------------------
    def log_steps(self, done: int) -> list[str]:
        """The /metrics rows and sink scalars of global steps up to `done` (the lowest version
        of any agent), each followed by its intervals and a full store flush; returns the log
        lines (every run.log_every steps, and the last)."""
        lines = []
        while self.logged_step < done:
            step = self.logged_step
            self.logged_step += 1
            now = self.time()
            wall = max(now - self.t_last, 1e-9)
            info = {agent: self.step_info(agent, step) for agent in self.agents}
            tis = self.tis_text(step)
            row, util, orch = self.metrics_row(step, wall, max(s for _, s in info.values()))
            if self.sinks:                      # run.loggers (reads the steps' rows back)
                self.sinks.write(step, step_scalars(self.store, step, row))
            if step % self.cfg.run.log_every == 0 or step == self.cfg.run.steps - 1:
                rewards = {agent: r for agent, (r, _) in info.items()}
                lines.append(self.log_line(step, rewards, row, util, orch) + tis)
            self.window.clear()
            self.t_last, self.samples_since, self.tokens_since = now, 0, 0
            self.forget_step(step)
            self.write_intervals()
            self.store.flush()
        return lines

    def metrics_row(self, step: int, wall: float, stale: int) -> tuple[dict, float, float]:
        """Append global step `step`'s /metrics row; returns it, the workers' utilization and
        the orchestrator's busy share."""
        workers = self.layout.workers          # replicas and trainer ranks (not the tool ranks)
        busy = sum(v for k, v in self.window.items())
        util = busy / (workers * wall)
        orch = self.clock.take_busy() / wall
        self.store.metrics.append(row := {
            "step": [step], "t": [self.store.now()], "wall": [wall], "samples": [self.samples_since],
            "tokens": [self.tokens_since], "samples_per_s": [self.samples_since / wall],
            "rollout_s": [self.window["generate"]], "train_s": [self.window["train"]],
            "sync_s": [self.window["sync"]], "swap_s": [self.window["swap"]],
            "utilization": [util], "staleness_max": [stale]})
        return row, util, orch

    def log_line(self, step: int, rewards: dict[str, float], row: dict, util: float, orch: float) -> str:
        rs = " ".join(f"{agent} {r:.3f}" for agent, r in rewards.items())
        return (f"step {step + 1:4d}/{self.cfg.run.steps} | reward {rs} | "
                f"{row['samples_per_s'][0]:7.1f} samples/s | stale {row['staleness_max'][0]} | "
                f"rollout {self.window['generate']:.2f}s train {self.window['train']:.2f}s "
                f"sync {self.window['sync']:.2f}s | util {100 * util:3.0f}% orch {100 * orch:3.0f}%")

    def tis_text(self, step: int) -> str:
        weights = {agent: self.tis.pop((agent, step), np.nan) for agent in self.agents}
        if not self.cfg.pipeline.max_staleness:
            return ""
        return " | tis w " + " ".join(f"{agent} {v:.6f}" for agent, v in weights.items())

    def step_info(self, agent: str, step: int) -> tuple[float, int]:
        """(reward_mean, staleness_max) of an agent's step: from memory, or from the store for
        a step an earlier (preempted) process of this run committed."""
        if (agent, step) in self.step_summary:
            return self.step_summary.pop((agent, step))
        rows = self.store.steps[agent].read()
        row = rows[(rows["step"] == step) & (rows["superseded"] == 0)][-1]
        return float(row["reward_mean"]), int(row["staleness_max"])

    # -- sinks -----------------------------------------------------------------------------
    def replay_eval_to_sinks(self) -> None:
        """A resumed process's sinks hide what the previous one logged from its first step on
        (TensorBoard purge_step); the evaluations of those steps are in the store, not redone."""
        rows = self.store.eval.read()
        for step, scalars in sink_scalars(rows[rows["step"] >= self.logged_step]).items():
            self.sinks.write(step, scalars)

    def close(self) -> None:
        self.sinks.close()
