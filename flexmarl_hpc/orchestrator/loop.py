"""The joint orchestrator (world rank 0): owns the workflow, the experience store, policy
versions and the scheduler, and drives replicas and trainer groups with messages.

One event loop serves both modes; the scheduler's gating decides whether it behaves as
the `sync` barrier baseline or as the `flex` micro-batch pipeline:

    while work remains:
        schedule()   admit steps, re-bind replicas (level 1), push weights, route requests
                     (level 2), hand out micro-batches
        handle()     record generations / train steps / syncs as they come back

Held-out evaluation (evaluation.py) rides on the same loop: its requests go to replicas
holding the evaluated version, its answers never reach the experience store.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from flexmarl_hpc.runtime import messages
from flexmarl_hpc.store.checkpoint import latest_version
from flexmarl_hpc.runtime.build import initial_placement
from flexmarl_hpc.config.schema import Config
from flexmarl_hpc.orchestrator.evaluation import GREEDY, Evaluator, sink_scalars
from flexmarl_hpc.orchestrator.experience import Experience, Node
from flexmarl_hpc.config.layout import ROLLOUT, RankLayout
from flexmarl_hpc.orchestrator.pool_binding import pool_binding
from flexmarl_hpc.config.resources import swap_peers, trainer_groups
from flexmarl_hpc.learn.sampling import SamplingParams
from flexmarl_hpc.orchestrator.scheduler import Scheduler, route
from flexmarl_hpc.orchestrator.sinks import open_sinks, step_scalars
from flexmarl_hpc.runtime.state_swap import Location
from flexmarl_hpc.store.tables import StoreFile
from flexmarl_hpc.runtime.timing import BusyClock, Deadlines, Watchdog, WatchedTask
from flexmarl_hpc.runtime.transport import Transport
from flexmarl_hpc.workflows.base import Task

EXIT_PREEMPTED = 75


@dataclass
class ReplicaState:
    rank: int
    busy: str | None = None           # None, "gen" or "sync"
    outstanding: float = 0.0          # estimated tokens of the batch in flight
    held: dict[str, int] = field(default_factory=dict)
    syncing_to: tuple[str, int] | None = None   # (agent, version) of the sync in flight
    queued: bool = False              # a generate batch waits behind that sync

    def free_for(self, agent: str, version: int) -> bool:
        """May a generate batch of `agent` at `version` be sent now? Idle, or syncing to
        exactly that version with nothing queued: the replica runs its commands in order,
        so the batch starts the moment the weights are in, not a round trip later."""
        return self.busy is None or (self.busy == "sync" and not self.queued
                                     and self.syncing_to == (agent, version))


@dataclass
class AgentState:
    version: int
    location: Location                # where its training state is (state_swap.Location)
    leader: int                       # world rank of the leader of that group
    consumed: int = 0                 # samples of step `version` handed to the trainer
    micro: int = 0
    inflight: int = 0                 # train messages not yet answered
    syncing: bool = False
    step_nodes: list = field(default_factory=list)


class Orchestrator:
    def __init__(self, cfg: Config, task: Task, transport: Transport, layout: RankLayout,
                 store: StoreFile, preempted=lambda: False, log=print):
        self.cfg, self.task, self.transport, self.layout = cfg, task, transport, layout
        self.store, self.preempted, self.log = store, preempted, log
        self.clock = BusyClock()                 # rank 0's own time, a row of the timeline
        self.deadlines = Deadlines(cfg.run.worker_timeout)
        self.watchdog = Watchdog(cfg.run.worker_timeout, self.reward_hung)
        self.exp = Experience(cfg, WatchedTask(task, self.watchdog), store)
        self.iv_rows: dict[str, list] = defaultdict(list)   # intervals not yet in the store
        self.aborting = False
        self.agents = cfg.agent_names
        ckpt = cfg.output_dir / "checkpoints"
        resume = cfg.run.resume
        self.state = {a: AgentState(version=(latest_version(ckpt / a, log) or 0) if resume else 0,
                                    location=loc, leader=layout.group_leader(loc.group))
                      for a, loc in initial_placement(cfg).items()}
        self.ckpt_time = {a: time.time() for a in self.agents}   # last checkpoint (run.checkpoint_minutes)
        self.moving: dict[int, int] = defaultdict(int)      # group -> state moves in flight
        self.replicas = [ReplicaState(r) for r in layout.replica_ranks]
        p = cfg.pipeline
        self.sched = Scheduler(self.agents, layout.replicas, cfg.run.mode, p.max_staleness,
                               p.load_balance, p.rebalance_threshold, p.rebalance_cooldown,
                               p.micro_batch_overlap)
        self.level1 = pool_binding(cfg, layout, self.sched)     # level 1 inside each pool
        self.binding = self.level1.initial_binding()
        self.swap_peers = lambda g, groups=trainer_groups(cfg): swap_peers(groups, g)
        self.batches: dict[int, tuple[int, str, int, list[Node]]] = {}
        self.next_batch = 0
        self.next_step = min(s.version for s in self.state.values())
        self.ckpt_pending = 0
        self.logged_step = self.next_step
        self.sinks = open_sinks(cfg, store, self.logged_step)     # run.loggers; HDF5 stays the source
        self.window = defaultdict(float)    # busy seconds by activity since the last log line
        self.t_last = time.time()
        self.samples_since = 0
        self.tokens_since = 0
        self.step_summary: dict[tuple, object] = {}     # per (agent, step): reward, staleness
        self.tis: dict[tuple, float] = {}               # per (agent, step): mean importance weight
        self.stepped: list[tuple] = []                  # finished steps not yet in /steps (record_steps)
        self.evals = Evaluator(cfg, WatchedTask(task, self.watchdog), set(store.eval.read()["step"].tolist()),
                               {a: s.version for a, s in self.state.items()}) if cfg.run.eval_every else None
        self.eval_batches: dict[int, tuple[int, str, int, list]] = {}

    # -- main loop -----------------------------------------------------------------------
    def run(self) -> int:
        try:
            return self._run()
        finally:
            self.watchdog.close()

    def _run(self) -> int:
        if self.next_step > 0 or self.store.samples_written():
            # whatever the trainers restored (version 0 too: no checkpoint), the store is
            # reconciled with it: later steps' rows are reused, their consumption undone
            versions = {a: s.version for a, s in self.state.items()}
            last = self.exp.reload(self.next_step, versions)
            superseded = self.store.supersede(versions, self.logged_step)
            self.next_step = max(self.next_step, last + 1)
            reloaded = f"steps {self.logged_step}..{last} reloaded from the store" \
                if last >= self.logged_step else "nothing uncommitted in the store"
            self.log(f"resumed at versions {versions}, {reloaded}, {superseded} step/metric rows "
                     f"superseded" + "".join(f"; store: {r}" for r in self.store.repaired))
        elif self.store.repaired:
            self.log("store: " + "; ".join(self.store.repaired))
        self.replay_eval_to_sinks()
        if self.evals is not None and self.evals.skipped:
            self.log(f"eval: steps {self.evals.skipped} cannot be evaluated any more (the restored "
                     "versions are past them)")
        while not self.finished():
            if self.preempted():
                return self.stop_preempted()
            with self.clock("schedule"):
                self.schedule()
            # after schedule(): the weight syncs a finished step unlocks are out before its
            # /steps row, checkpoint, log line, metrics row and full store flush are made
            self.record_steps()
            self.maybe_log()
            self.handle(*self.receive())
            while (m := self.transport.poll()) is not None:
                self.handle(*m)
        self.checkpoint(self.agents)
        self.stop_workers(0)
        return 0

    def finished(self) -> bool:
        steps = self.cfg.run.steps
        return all(s.version >= steps and s.inflight == 0 for s in self.state.values()) and (
            self.evals is None or self.evals.finished())

    # -- scheduling ----------------------------------------------------------------------
    def schedule(self) -> None:
        versions = {a: s.version for a, s in self.state.items()}
        while self.next_step < self.cfg.run.steps and self.sched.may_admit(
                self.next_step, versions, self.all_synced()):
            self.exp.admit_step(self.next_step)
            self.next_step += 1
        if self.evals is not None:
            self.evals.start(versions, self.store.now())
        backlog = {a: sum(self.exp.est_tokens(n) for n in self.exp.pending[a]) for a in self.agents}
        if self.evals is not None:                # an agent with only eval work gets a replica too
            backlog = {a: b + self.evals.pending_tokens(a) for a, b in backlog.items()}
        free = self.syncable()                    # once per round, not per replica (1000s at scale)
        new = self.level1.rebind(backlog, self.binding, [r.busy is None for r in self.replicas],
                                 [self.servable(r, free) for r in self.replicas])
        if new is not None:
            self.binding = new
        self.push_weights()
        for a in self.agents:                     # generation first: the replicas wait on
            self.dispatch_generation(a)           # this rank, while a trainer's second
        for a in self.agents:                     # micro-batch is often still queued
            self.dispatch_training(a)
            if self.evals is not None:
                self.dispatch_eval(a)

    def syncable(self) -> set[str]:
        """Agents push_weights may sync this round: not syncing, not in flight, group idle."""
        return {a for a, st in self.state.items()
                if not (st.syncing or st.inflight or self.group_busy(st.location.group))}

    def servable(self, r, free: set[str] | None = None) -> set[str]:
        """Agents replica `r` could generate for now: it holds their current weights, or
        push_weights may sync them to it this round (time-sharing rebinds only to these);
        `free`: this round's syncable(), computed once by the caller."""
        free = self.syncable() if free is None else free
        return {a for a, st in self.state.items() if a in free or r.held.get(a) == st.version}

    def all_synced(self) -> bool:
        return all(r.busy is None and r.held.get(a) == self.state[a].version
                   for r, a in zip(self.replicas, self.binding))

    def push_weights(self) -> None:
        """Send each agent's current version to its idle bound replicas that lack it."""
        if self.cfg.run.mode == "sync" and len({s.version for s in self.state.values()}) > 1:
            return                               # baseline: every agent trains, then all sync
        for a, st in self.state.items():
            # mid-step (some micro-batches consumed, none in flight) the trainer still holds
            # st.version: its weights change only at the step's last micro-batch. Waiting for
            # the step to end instead deadlocks when that step's missing samples need a replica
            # that lacks st.version (a re-bound one, with max_staleness >= 1).
            if st.syncing or st.inflight or self.group_busy(st.location.group):
                continue
            hold = self.eval_hold(a)
            if hold is not None and st.version > hold:
                continue                         # the replicas keep the version being evaluated
            targets = [r for r, b in zip(self.replicas, self.binding)
                       if b == a and r.busy is None and r.held.get(a) != st.version]
            if not targets:
                continue
            members = (st.leader,) + tuple(sorted(r.rank for r in targets))
            what = f"weight sync of agent {a} v{st.version}"
            self.cmd(st.leader, messages.Sync(a, st.version, members), what)
            for r in targets:
                self.cmd(r.rank, messages.Sync(a, st.version, members), what)
                r.busy, r.syncing_to = "sync", (a, st.version)
            st.syncing = True

    def dispatch_generation(self, agent: str) -> None:
        st = self.state[agent]
        mine = [r for r, b in zip(self.replicas, self.binding) if b == agent and (
                (r.held.get(agent) == st.version and r.busy != "sync") or r.syncing_to == (agent, st.version))]
        if not any(r.free_for(agent, st.version) for r in mine):
            return
        eligible = [n for n in self.exp.pending[agent] if self.sched.may_generate(
            n.step, st.version, self.exp.turn_left.get((n.step, n.turn - 1), 0))]
        if not eligible:
            return
        plan = route([self.exp.est_tokens(n) for n in eligible],
                     {r.rank: r.outstanding for r in mine})
        sent = set()
        for r in mine:
            if not r.free_for(agent, st.version) or not plan[r.rank]:
                continue
            nodes = [eligible[i] for i in plan[r.rank]][: self.cfg.rollout.max_batch]
            reqs = [(n.sample_id, n.prompt, self.exp.request_seed(n, st.version),
                     self.task.response_budget(n.turn, n.sample_id,
                                               self.cfg.workflow.turns[n.turn].max_new_tokens),
                     n.turn) for n in nodes]
            bid = self.next_batch = self.next_batch + 1
            self.batches[bid] = (r.rank, agent, st.version, nodes)
            self.cmd(r.rank, messages.Generate(bid, agent, st.version, reqs),
                     f"generate batch {bid} of agent {agent} ({len(reqs)} requests)")
            r.outstanding = sum(self.exp.est_tokens(n) for n in nodes)
            if r.busy == "sync":
                r.queued = True
            else:
                r.busy = "gen"
            sent.update(id(n) for n in nodes)
        if sent:
            q = self.exp.pending[agent]
            keep = [n for n in q if id(n) not in sent]
            q.clear()
            q.extend(keep)

    def eval_hold(self, agent: str) -> int | None:
        """The version of `agent` an unfinished evaluation still needs on the replicas."""
        return None if self.evals is None else self.evals.hold(agent)

    def dispatch_eval(self, agent: str) -> None:
        """Send `agent`'s pending evaluation requests to idle replicas holding the version
        they evaluate (its bound replicas first: another agent's replica may switch engines)."""
        idle = sorted((r for r in self.replicas if r.busy is None and r.held.get(agent) is not None),
                      key=lambda r: self.binding[r.rank - 1] != agent)
        for r in idle:
            version = r.held[agent]
            nodes = self.evals.ready(agent, version)[: self.cfg.rollout.max_batch]
            if not nodes:
                continue
            self.evals.take(nodes)
            ro = self.cfg.rollout
            params = SamplingParams(0.0 if nodes[0].mode == GREEDY else ro.temperature, ro.top_p)
            bid = self.next_batch = self.next_batch + 1
            self.eval_batches[bid] = (r.rank, agent, version, nodes)
            self.cmd(r.rank, messages.Generate(bid, agent, version, [self.evals.request(n) for n in nodes], params),
                     f"evaluation batch {bid} of agent {agent} v{version} ({len(nodes)} requests)")
            r.busy, r.outstanding = "gen", float(sum(len(n.prompt) for n in nodes))

    def replay_eval_to_sinks(self) -> None:
        """A resumed process's sinks hide what the previous one logged from its first step on
        (TensorBoard purge_step); the evaluations of those steps are in the store, not redone."""
        rows = self.store.eval.read()
        for step, scalars in sink_scalars(rows[rows["step"] >= self.logged_step]).items():
            self.sinks.write(step, scalars)

    def on_eval_generated(self, bid: int, gens: list) -> None:
        """Evaluation answers: never journalled; a finished round becomes /eval rows, a log
        line and sink scalars."""
        rank, agent, version, nodes = self.eval_batches.pop(bid)
        r = self.replicas[rank - 1]
        r.busy, r.outstanding = None, 0.0
        for res in self.evals.record(nodes, [t for t, _ in gens], version, self.store.now()):
            with self.clock("store"):
                self.store.append_eval(res.rows)
                self.store.flush()
            written = self.store.eval.read(self.store.eval.disk - len(res.rows["step"]))
            self.sinks.write(res.point, sink_scalars(written)[res.point])     # as the store has them
            secs = res.rows["t_end"][0] - res.rows["t_start"][0]
            self.log(f"eval at step {res.point:4d} | " + " ".join(f"{k} {v:.3f}" for k, v in res.summary.items())
                     + f" | {res.rows['n_inputs'][0]} held-out inputs, {secs:.1f} s")

    def next_micro(self, agent: str) -> int:
        """Size of the micro-batch the scheduler would hand `agent`'s trainer now (0: none)."""
        st = self.state[agent]
        step = st.version
        if step >= self.cfg.run.steps:
            return 0
        complete = all(self.exp.ready_count(b, step) + self.state[b].consumed
                       == self.exp.batch_size[b] for b in self.agents if self.state[b].version == step)
        return self.sched.micro_batch(self.exp.ready_count(agent, step),
                                      self.exp.batch_size[agent] - st.consumed,
                                      self.cfg.trainer.micro_batch_size, complete)

    def group_busy(self, g: int) -> bool:
        return self.moving[g] > 0 or any(
            s.location.group == g and (s.inflight or s.syncing) for s in self.state.values())

    def acquire_group(self, agent: str) -> None:
        """Agent-centric allocation: bind a parked agent with work to a trainer group, parking
        that group's resident agent if it sits at a step boundary with nothing to train."""
        st = self.state[agent]
        src = st.location
        order = self.swap_peers(src.group)      # its own group first, then same-shape groups
        for g in order:
            if self.group_busy(g) or (src.group != g and self.group_busy(src.group)):
                continue
            resident = [a for a, s in self.state.items() if s.location == Location(g, True)]
            if resident:
                r = self.state[resident[0]]
                if r.consumed or r.inflight or r.syncing or self.next_micro(resident[0]):
                    continue
                self.send_move(resident[0], Location(g, True), Location(g, False))
            self.send_move(agent, src, Location(g, True))
            return

    def send_move(self, agent: str, src: Location, dst: Location) -> None:
        for g in sorted({src.group, dst.group}):
            self.cmd(self.layout.group_leader(g), messages.Move(agent, src, dst), f"state move of agent {agent}")
            self.moving[g] += 1
        st = self.state[agent]
        st.location, st.leader = dst, self.layout.group_leader(dst.group)

    def dispatch_training(self, agent: str) -> None:
        st = self.state[agent]
        if st.syncing or st.inflight >= 2 or self.moving[st.location.group]:
            return
        if self.eval_hold(agent) == st.version and not any(
                r.held.get(agent) == st.version for r in self.replicas):
            return          # an evaluated version reaches a replica before it is trained past
        if not st.location.resident:
            if self.next_micro(agent):
                self.acquire_group(agent)
            return
        step, batch = st.version, self.exp.batch_size[agent]
        while st.inflight < 2:
            k = self.next_micro(agent)
            if k == 0:
                return
            with self.clock("store"):            # CONSUMED flushed before the trainer sees them
                nodes = self.exp.take_ready(agent, step, k)
            st.consumed += len(nodes)
            st.micro += 1
            st.step_nodes.extend(nodes)
            last = st.consumed == batch
            self.cmd(st.leader, messages.Train(agent, step, self.micro_arrays(nodes), 1.0 / batch, last),
                     f"train micro-batch {st.micro} of agent {agent} step {step}")
            st.inflight += 1

    def micro_arrays(self, nodes: list[Node]) -> dict:
        """The padded arrays of a micro-batch, filled by one scatter per array (not per sample)."""
        P = np.array([len(n.prompt) for n in nodes])
        R = np.array([len(n.response) for n in nodes])
        L = P + R
        B, T = len(nodes), int(L.max())
        col = np.arange(T)
        ids = np.full((B, T), self.task.vocab.pad_id, dtype=np.int64)
        ids[col < L[:, None]] = np.fromiter(
            (t for n in nodes for part in (n.prompt, n.response) for t in part), np.int64, int(L.sum()))
        behav = np.zeros((B, T), dtype=np.float32)
        behav[(col >= P[:, None]) & (col < L[:, None])] = np.fromiter(
            (x for n in nodes for x in n.logprobs), np.float32, int(R.sum()))
        turns = {n.turn for n in nodes}
        masks = {t: self.task.allowed_tokens(t) for t in turns}
        allowed = None
        if any(m is not None for m in masks.values()):
            V = len(self.task.vocab)
            rows = {t: np.ones(V, bool) if m is None else m.numpy() for t, m in masks.items()}
            allowed = np.stack([rows[n.turn] for n in nodes])
        return {"input_ids": ids, "behav_logprobs": behav, "allowed": allowed,
                "prompt_lens": P, "response_lens": R,
                "advantages": np.array([n.advantage for n in nodes], dtype=np.float32),
                "stale": np.array([n.version < n.step for n in nodes])}

    # -- messages --------------------------------------------------------------------------
    def cmd(self, rank: int, msg: messages.Command, what: str) -> None:
        """Send a command; `what` names it if the rank then stops answering."""
        self.transport.send(rank, msg)
        self.deadlines.sent(rank, what)

    def receive(self) -> tuple[int, messages.Reply]:
        """The next reply as (source rank, message), waiting without a spin; a rank that
        leaves its command unanswered for run.worker_timeout seconds ends the job with the
        requeue code."""
        while True:
            try:
                return self.transport.receive(self.deadlines.next_deadline())
            except TimeoutError:
                late = self.deadlines.overdue()
                if late is not None:
                    self.stop_hung(*late)

    # -- results -------------------------------------------------------------------------
    def handle(self, src: int, msg: messages.Reply) -> None:
        with self.clock("handle"):
            self._handle(src, msg)

    def _handle(self, src: int, msg: messages.Reply) -> None:
        if not isinstance(msg, messages.Intervals):
            self.deadlines.answered(src)
        if isinstance(msg, messages.Generated) and msg.batch_id in self.eval_batches:
            self.on_eval_generated(msg.batch_id, msg.outputs)
        elif isinstance(msg, messages.Generated):
            rank, agent, version, nodes = self.batches.pop(msg.batch_id)
            r = self.replicas[rank - 1]
            r.busy, r.outstanding = None, 0.0
            # the replica's next batch, from what was already pending, goes out before this
            # one is recorded (the tree and the store take ~0.5 ms the replica would idle)
            self.dispatch_generation(agent)
            with self.clock("store"):   # rows are flushed with the next micro-batch's CONSUMED
                self.exp.record_generation([(n, t, lp) for n, (t, lp) in zip(nodes, msg.outputs)],
                                           version, rank - 1)
            self.tokens_since += sum(len(t) for t, _ in msg.outputs)
        elif isinstance(msg, messages.Synced):
            r = self.replicas[msg.replica]
            r.held[msg.agent], r.syncing_to = msg.version, None
            r.busy, r.queued = ("gen" if r.queued else None), False
        elif isinstance(msg, messages.TrainerSynced):
            self.state[msg.agent].syncing = False
        elif isinstance(msg, messages.Trained):
            self.state[msg.agent].inflight -= 1
        elif isinstance(msg, messages.Stepped):
            self.on_stepped(msg.agent, msg.version, msg.stats)
        elif isinstance(msg, messages.Checkpointed):
            self.ckpt_pending -= 1
        elif isinstance(msg, messages.Moved):
            self.moving[self.layout.role_of(src)[1]] -= 1
        elif isinstance(msg, (messages.Stopped, messages.Intervals)):
            pass
        else:
            raise RuntimeError(f"orchestrator: unknown reply {msg!r}")
        self.record_intervals(src, msg.intervals)

    def record_intervals(self, src: int, intervals: list, count: bool = True) -> None:
        """Buffer a rank's intervals; they reach the store once a logged step (one append)."""
        if not intervals:
            return
        role, _ = self.layout.role_of(src)
        if count:
            for act, _, a, b in intervals:
                if act != "wait":
                    self.window[act] += b - a
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

    def on_stepped(self, agent: str, version: int, stats: dict) -> None:
        st = self.state[agent]
        st.inflight -= 1
        nodes, st.step_nodes = st.step_nodes, []
        step = version - 1
        stale = np.array([step - nd.version for nd in nodes])
        reward = float(np.mean([nd.reward for nd in nodes]))
        self.step_summary[(agent, step)] = (reward, int(stale.max(initial=0)))
        # mean truncated importance weight of the step's samples (trainer stats are sums
        # over samples); the log shows it when pipeline.max_staleness > 0
        tis = self.tis[(agent, step)] = stats.get("tis_mean", np.nan) / max(len(nodes), 1)
        self.stepped.append((agent, version, stats, nodes, reward, stale, tis, st.micro))
        st.version, st.consumed, st.micro = version, 0, 0
        self.samples_since += len(nodes)

    def record_steps(self, checkpoints: bool = True) -> None:
        """The /steps rows of the steps finished since the last call, and the checkpoints
        they make due. The main loop calls it after schedule(), so a finished step's weight
        syncs go out before its bookkeeping and before its checkpoint (which would hold the
        trainer for the checkpoint's duration); checkpoint() calls it before it commits."""
        if not self.stepped:
            return
        done, self.stepped = self.stepped, []
        with self.clock("store"):
            for args in done:
                self._append_step(*args)
            # written now, committed by the next flush: checkpoint() commits before it sends
            self.store.flush(full=False)
        due = [a for a, v, *_ in done if checkpoints and self.checkpoint_due(a, v)]
        if due:
            for a in due:
                self.ckpt_time[a] = time.time()
            self.checkpoint(due, wait=False)

    def _append_step(self, agent: str, version: int, stats: dict, nodes: list, reward: float,
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

    def checkpoint_due(self, agent: str, version: int) -> bool:
        """run.checkpoint_every steps or run.checkpoint_minutes since this agent's last one
        (the last step is checkpointed at the end of run() anyway)."""
        run = self.cfg.run
        if version >= run.steps:
            return False
        by_steps = run.checkpoint_every > 0 and version % run.checkpoint_every == 0
        by_time = 0 < run.checkpoint_minutes * 60 <= time.time() - self.ckpt_time[agent]
        return by_steps or by_time

    def maybe_log(self) -> None:
        """Log every global step all agents have finished (the main loop calls it after each
        schedule(); checkpoint() and stop_workers() before they act)."""
        if min(s.version for s in self.state.values()) > self.logged_step:
            with self.clock("log"):
                self._maybe_log()

    def _maybe_log(self) -> None:
        done = min(s.version for s in self.state.values())
        while self.logged_step < done:
            step = self.logged_step
            self.logged_step += 1
            now = time.time()
            wall = max(now - self.t_last, 1e-9)
            info = {a: self.step_info(a, step) for a in self.agents}
            tis = self.tis_text(step)
            rew = {a: r for a, (r, _) in info.items()}
            stale = max(s for _, s in info.values())
            workers = self.layout.world_size - 1
            busy = sum(v for k, v in self.window.items())
            util = busy / (workers * wall)
            orch = self.clock.take_busy() / wall
            self.store.metrics.append(row := {
                "step": [step], "t": [self.store.now()], "wall": [wall], "samples": [self.samples_since],
                "tokens": [self.tokens_since], "samples_per_s": [self.samples_since / wall],
                "rollout_s": [self.window["generate"]], "train_s": [self.window["train"]],
                "sync_s": [self.window["sync"]], "swap_s": [self.window["swap"]],
                "utilization": [util], "staleness_max": [stale]})
            if self.sinks:                      # run.loggers (reads the steps' rows back)
                self.sinks.write(step, step_scalars(self.store, step, row))
            if step % self.cfg.run.log_every == 0 or step == self.cfg.run.steps - 1:
                rs = " ".join(f"{a} {r:.3f}" for a, r in rew.items())
                self.log(f"step {step + 1:4d}/{self.cfg.run.steps} | reward {rs} | "
                         f"{self.samples_since / wall:7.1f} samples/s | stale {stale} | "
                         f"rollout {self.window['generate']:.2f}s train {self.window['train']:.2f}s "
                         f"sync {self.window['sync']:.2f}s | util {100 * util:3.0f}% orch {100 * orch:3.0f}%"
                         + tis)
            self.window.clear()
            self.t_last, self.samples_since, self.tokens_since = now, 0, 0
            self.exp.forget_step(step)
            self.write_intervals()
            self.store.flush()

    def tis_text(self, step: int) -> str:
        w = {a: self.tis.pop((a, step), np.nan) for a in self.agents}
        if not self.cfg.pipeline.max_staleness:
            return ""
        return " | tis w " + " ".join(f"{a} {v:.6f}" for a, v in w.items())

    def step_info(self, agent: str, step: int) -> tuple[float, int]:
        """(reward_mean, staleness_max) of an agent's step: from memory, or from the store for
        a step an earlier (preempted) process of this run committed."""
        if (agent, step) in self.step_summary:
            return self.step_summary.pop((agent, step))
        rows = self.store.steps[agent].read()
        row = rows[(rows["step"] == step) & (rows["superseded"] == 0)][-1]
        return float(row["reward_mean"]), int(row["staleness_max"])

    # -- checkpoints and shutdown ----------------------------------------------------------
    def checkpoint(self, agents: list[str], wait: bool = True) -> None:
        self.record_steps(checkpoints=False)
        self.maybe_log()                # a resume starts logging at the checkpoint's steps
        with self.clock("store"):
            self.store.flush()          # committed before a checkpoint can hold a version
        by_group = defaultdict(list)
        for a in agents:
            by_group[self.state[a].leader].append(a)
        for leader, names in by_group.items():
            self.cmd(leader, messages.Checkpoint(names), f"checkpoint of {', '.join(names)}")
            self.ckpt_pending += 1
        while wait and self.ckpt_pending > 0:
            self.handle(*self.receive())
        self.store.flush()

    def drain(self) -> None:
        """Wait until no generation, training or sync is in flight."""
        while (self.batches or self.eval_batches or any(r.busy for r in self.replicas)
               or any(s.inflight or s.syncing for s in self.state.values()) or self.ckpt_pending
               or any(self.moving.values())):
            self.handle(*self.receive())

    def stop_preempted(self) -> int:
        self.log("preemption signal: draining, checkpointing every agent, flushing the store")
        self.drain()
        self.checkpoint(self.agents)
        self.stop_workers(EXIT_PREEMPTED)
        return EXIT_PREEMPTED

    def stop_workers(self, code: int) -> None:
        self.drain()
        targets = [r.rank for r in self.replicas] + [self.layout.group_leader(g)
                                                     for g in range(self.layout.groups)]
        for rank in targets:
            self.cmd(rank, messages.Stop(code), "stop")
        # every worker rank answers "stopped" last (group members too: the leader forwards
        # the stop), so once all have, no interval message is left in flight
        pending = self.layout.world_size - 1
        while pending:
            src, msg = self.receive()
            self.handle(src, msg)
            pending -= isinstance(msg, messages.Stopped)
        self.record_steps(checkpoints=False)
        self.maybe_log()
        self.write_intervals()
        self.store.flush()
        self.sinks.close()

    # -- hung workers ----------------------------------------------------------------------
    def stop_hung(self, rank: int, what: str, secs: float) -> None:
        """A worker left a command unanswered for run.worker_timeout: say who and what,
        checkpoint the agents whose trainer groups still answer, flush the store, and end
        the whole job with the requeue code (a hung rank cannot be stopped by a message)."""
        role, index = self.layout.role_of(rank)
        who = f"replica {index}" if role == ROLLOUT else f"trainer group {index} (leader)"
        self.log(f"{who} (rank {rank}): no answer to {what} for {secs:.0f} s "
                 f"(run.worker_timeout={self.cfg.run.worker_timeout:g})")
        if not self.aborting:
            self.aborting = True
            self.deadlines.forget(rank)
            alive = [a for a, s in self.state.items() if s.leader != rank and not self.moving[s.location.group]]
            if alive:
                self.log(f"checkpointing {', '.join(alive)}, flushing the store, exiting {EXIT_PREEMPTED} to requeue")
                self.checkpoint(alive)
        self.abort(EXIT_PREEMPTED)

    def reward_hung(self, what: str, secs: float) -> None:
        """The watchdog thread: rank 0 itself is stuck in a reward function. The main thread
        cannot checkpoint, so flush what the store has and end the job for a requeue."""
        self.log(f"reward function (orchestrator, rank 0): no return from {what} for {secs:.0f} s "
                 f"(run.worker_timeout={self.cfg.run.worker_timeout:g}); flushing the store, "
                 f"exiting {EXIT_PREEMPTED} to requeue")
        self.abort(EXIT_PREEMPTED)

    def abort(self, code: int) -> None:
        try:
            self.record_steps(checkpoints=False)
            self.write_intervals()
            self.store.flush()
        finally:
            self.transport.abort(code)
