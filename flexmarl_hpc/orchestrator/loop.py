"""The joint orchestrator (world rank 0): owns the workflow, the experience store, policy
versions and the scheduler, and drives replicas and trainer groups with messages.

One event loop serves both modes; the scheduler's gating decides whether it behaves as
the `sync` barrier baseline or as the `flex` micro-batch pipeline:

    while work remains:
        schedule()   admit steps, re-bind replicas (level 1), push weights, route requests
                     (level 2), hand out micro-batches
        handle()     record generations / train steps / syncs as they come back

Held-out evaluation (eval_dispatch.py) rides on the same loop: its requests go to replicas
holding the evaluated version, its answers never reach the experience store. What the run
writes besides the samples (intervals, /steps, /metrics, log lines, sinks) is recorder.py's.
"""
from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flexmarl_hpc.clock import REAL, Clock
from flexmarl_hpc.config.plan import Plan
from flexmarl_hpc.config.resources import swap_peers
from flexmarl_hpc.orchestrator.eval_dispatch import eval_dispatch
from flexmarl_hpc.orchestrator.experience import Node, experience_for
from flexmarl_hpc.orchestrator.checkpoint_timer import CheckpointTimer
from flexmarl_hpc.orchestrator.failures import FailureHandler, Stops
from flexmarl_hpc.orchestrator.pool_binding import pool_binding
from flexmarl_hpc.orchestrator.recorder import RunRecorder
from flexmarl_hpc.orchestrator.scheduler import Gate, route
from flexmarl_hpc.runtime import messages
from flexmarl_hpc.runtime.messages import Location
from flexmarl_hpc.runtime.placement import initial_placement
from flexmarl_hpc.runtime.timing import BusyClock, Deadlines, Watchdog, WatchedTask
from flexmarl_hpc.store.checkpoint import latest_version
from flexmarl_hpc.store.tables import StoreFile
from flexmarl_hpc.workflows.base import Task

if TYPE_CHECKING:    # runtime/transport.py imports MPI; simulate and unit tests pass other transports
    from flexmarl_hpc.runtime.transport import Transport


UNKNOWN_BATCH = 1 << 40
"""`remaining` samples of a step whose batch size is not known yet (episode workflows)."""


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

    def assigned(self, tokens: float) -> None:
        """A generate batch of about `tokens` was sent (behind a sync in flight, if any)."""
        self.outstanding = tokens
        if self.busy == "sync":
            self.queued = True
        else:
            self.busy = "gen"

    def synced(self, agent: str, version: int, dropped: tuple[str, ...] = ()) -> None:
        """The weights are in (those of `dropped` are gone: re-sent when wanted); a batch
        queued behind them is now running."""
        for other in dropped:
            self.held.pop(other, None)
        self.held[agent], self.syncing_to = version, None
        self.busy, self.queued = ("gen" if self.queued else None), False

    def done(self) -> None:
        """A generate batch was answered."""
        self.busy, self.outstanding = None, 0.0


@dataclass
class AgentState:
    version: int
    location: Location                # where its training state is (messages.Location)
    leader: int                       # world rank of the leader of that group
    consumed: int = 0                 # samples of step `version` handed to the trainer
    micro: int = 0
    inflight: int = 0                 # train messages not yet answered
    syncing: bool = False
    step_nodes: list = field(default_factory=list)

    def finish_step(self, version: int) -> tuple[list, int]:
        """The optimizer step's reply is in: the trainer holds `version`; returns the step's
        samples and its number of micro-batches."""
        done = self.step_nodes, self.micro
        self.inflight -= 1
        self.version, self.consumed, self.micro, self.step_nodes = version, 0, 0, []
        return done


def pack(nodes: list[Node], task: Task) -> dict:
    """runtime.microbatch.pack_microbatch, imported on the first micro-batch: it imports torch,
    which importing the orchestrator must not (tests/unit/test_imports.py)."""
    from flexmarl_hpc.runtime.microbatch import pack_microbatch
    return pack_microbatch(nodes, task)


def initial_state(plan: Plan, log) -> dict[str, AgentState]:
    """Each agent where runtime.placement.initial_placement puts it, at its newest valid
    checkpoint's version (run.resume; checkpoint.latest_version reports bad ones) or 0."""
    cfg, ckpt = plan.cfg, plan.cfg.output_dir / "checkpoints"
    return {agent: AgentState(version=(latest_version(ckpt / agent, log) or 0) if cfg.run.resume else 0,
                              location=loc, leader=plan.layout.group_leader(loc.group))
            for agent, loc in initial_placement(plan.groups, cfg.agent_names).items()}


def servable_by(held: dict[str, int], free: set[str], current: dict[str, int]) -> set[str]:
    """Agents a replica holding `held` (agent -> version) could generate for now: it holds
    their `current` version, or push_weights may sync them to it this round (`free`, the
    round's Orchestrator.syncable()); time-sharing rebinds only to these. Both sets are made
    once a round by the caller: this runs per replica per round (a scan of every agent
    here was 8% of `simulate paper`)."""
    return free | {agent for agent, v in held.items() if current.get(agent) == v}


def booked(activity: str):
    """Book a method's time on the orchestrator's BusyClock (`self.clock`) as `activity`."""
    def wrap(fn):
        @functools.wraps(fn)
        def booked_fn(self, *args, **kwargs):
            with self.clock(activity):
                return fn(self, *args, **kwargs)
        return booked_fn
    return wrap


class Orchestrator:
    def __init__(self, plan: Plan, task: Task, transport: Transport,
                 store: StoreFile, preempted=lambda: False, log=print, tools=None, clock: Clock = REAL):
        """`plan`: the resolved run (config/plan.py; its layout is the world the transport
        reaches). `tools`: where episodes' tool calls run (ranks/tool_ranks.py's RemotePool on the
        layout's tool ranks); None: a process pool on this node. `clock`: the run's (the
        transport's: a simulation's is sim.transport.SimTransport.clock), the store's too."""
        if store.clock is not clock:
            raise ValueError(f"{store.path}: the store reads another clock than the orchestrator")
        cfg, layout = plan.cfg, plan.layout
        self.cfg, self.task, self.transport, self.layout = cfg, task, transport, layout
        self.store, self.preempted, self.log = store, preempted, log
        self.clock = BusyClock(clock)            # rank 0's own time, a row of the timeline
        self.deadlines = Deadlines(cfg.run.worker_timeout, clock)
        self.watchdog = Watchdog(cfg.run.worker_timeout, lambda what, secs: self.failures.reward_hung(what, secs))
        self.exp = experience_for(cfg, WatchedTask(task, self.watchdog), store, tools)
        self.agents = cfg.agent_names
        self.state = initial_state(plan, log)
        self.moving: dict[int, int] = defaultdict(int)      # group -> state moves in flight
        self.replicas = [ReplicaState(r) for r in layout.replica_ranks]
        self.gate = Gate.for_run(cfg)
        self.pools = pool_binding(plan)            # level 1 inside each pool
        self.binding = self.pools.initial_binding()
        self.trainer_groups = plan.groups
        self.batches: dict[int, tuple[int, str, int, list[Node]]] = {}
        self.next_batch = 0
        self.next_step = min(s.version for s in self.state.values())
        self.ckpt_pending: dict[int, int] = defaultdict(int)     # leader -> checkpoints unanswered
        self.recorder = RunRecorder(cfg, layout, store, self.clock, self.next_step, self.exp.forget_step)
        self.ckpt_timer = CheckpointTimer(cfg.run, self.agents, clock.time)
        self.evals = eval_dispatch(cfg, WatchedTask(task, self.watchdog), store, self.versions(),
                                   self.clock, self.recorder.sinks)
        self.failures = FailureHandler(cfg, layout, transport, self.deadlines, store, self.exp, self.state,
                                       self.moving, Stops(self.drain, self.checkpoint, self.stop_workers,
                                                          self.flush_for_abort), preempted, log)

    def versions(self) -> dict[str, int]:
        return {agent: s.version for agent, s in self.state.items()}

    # -- main loop -----------------------------------------------------------------------
    def run(self) -> int:
        with contextlib.closing(self.watchdog):
            self.resume()
            while not self.finished():
                if self.preempted():
                    return self.failures.stop_preempted()
                with self.clock("schedule"):
                    self.schedule()
                # after schedule(): the weight syncs a finished step unlocks are out before its
                # /steps row, checkpoint, log line, metrics row and full store flush are made
                self.record_steps()
                self.maybe_log()
                m = self.failures.receive(wake=self.exp.waiting() or self.evals.waiting(), loop=True)
                if self.failures.stalled:
                    return self.failures.stop_stalled()
                if m is not None:
                    self.handle(*m)
                while (m := self.transport.poll()) is not None:
                    self.handle(*m)
            if self.failures.episodes_failing():
                return self.failures.stop_failing()
            self.checkpoint(self.agents)
            self.stop_workers(0)
            return 0

    def resume(self) -> None:
        """Reconcile the store with the versions the trainers restored, and say what was."""
        logged = self.recorder.logged_step
        if self.next_step > 0 or self.store.samples_written():
            # whatever the trainers restored (version 0 too: no checkpoint), the store is
            # reconciled with it: later steps' rows are reused, their consumption undone
            versions = self.versions()
            last = self.exp.reload(self.next_step, versions)
            superseded = self.store.supersede(versions, logged)
            self.next_step = max(self.next_step, last + 1)
            reloaded = f"steps {logged}..{last} reloaded from the store" \
                if last >= logged else "nothing uncommitted in the store"
            self.log(f"resumed at versions {versions}, {reloaded}, {superseded} step/metric rows "
                     f"superseded" + "".join(f"; store: {r}" for r in self.store.repaired))
            for step, gone in sorted(self.exp.lost_inputs.items()):
                self.log(f"step {step}: inputs {sorted(gone)} are not in the store (salvaged) and an "
                         "agent's checkpoint is past the step: trained without them")
        elif self.store.repaired:
            self.log("store: " + "; ".join(self.store.repaired))
        self.store.settle()             # reconciled: the re-open's repairs stand (store/undo.py)
        self.recorder.replay_eval_to_sinks()
        if self.evals.skipped:
            self.log(f"eval: steps {self.evals.skipped} cannot be evaluated any more (the restored "
                     "versions are past them)")

    def finished(self) -> bool:
        """Every step trained and evaluated, or too many episodes failed (episodes_failing)."""
        steps = self.cfg.run.steps
        return self.failures.episodes_failing() or (all(s.version >= steps and s.inflight == 0 for s in self.state.values())
                                           and self.evals.finished())

    # -- scheduling ----------------------------------------------------------------------
    def schedule(self) -> None:
        with self.clock("store"):
            self.exp.poll()                       # episodes that went on after a tool result
        versions = self.versions()
        while self.next_step < self.cfg.run.steps and self.gate.may_admit(
                self.next_step, versions, self.all_synced()):
            self.exp.admit_step(self.next_step)
            self.next_step += 1
        for line in self.evals.start(versions, self.store.now()):
            self.log(line)
        # an agent with only eval work gets a replica too
        backlog = {agent: sum(self.exp.est_tokens(n) for n in self.exp.pending[agent])
                   + self.evals.pending_tokens(agent) for agent in self.agents}
        servable = None                           # read by flex's load balancing only
        if self.pools.wants_servable:
            free = self.syncable()                # once per round, not per replica (1000s at scale)
            current = {agent: st.version for agent, st in self.state.items()}
            servable = [servable_by(r.held, free, current) for r in self.replicas]
        new = self.pools.rebind(backlog, self.binding, [r.busy is None for r in self.replicas], servable)
        if new is not None:
            self.binding = new
        self.push_weights()
        bound: dict[str, list[ReplicaState]] = {}  # one pass over the replicas, not one per agent
        for r, b in zip(self.replicas, self.binding):
            bound.setdefault(b, []).append(r)
        for agent in self.agents:                 # generation first: the replicas wait on
            self.dispatch_generation(agent, bound)  # this rank, while a trainer's second
        for agent in self.agents:                 # micro-batch is often still queued
            self.dispatch_training(agent)
            self.evals.dispatch(agent, self.replicas, self.binding, self.new_batch_id, self.cmd)

    def new_batch_id(self) -> int:
        self.next_batch += 1
        return self.next_batch

    def syncable(self) -> set[str]:
        """Agents push_weights may sync this round: not syncing, not in flight, group idle."""
        return {agent for agent, st in self.state.items()
                if not (st.syncing or st.inflight or self.group_busy(st.location.group))}

    def all_synced(self) -> bool:
        return all(r.busy is None and r.held.get(agent) == self.state[agent].version
                   for r, agent in zip(self.replicas, self.binding))

    def push_weights(self) -> None:
        """Send each agent's current version to its idle bound replicas that lack it."""
        if self.cfg.run.mode == "sync" and len({s.version for s in self.state.values()}) > 1:
            return                               # baseline: every agent trains, then all sync
        for agent, st in self.state.items():
            # mid-step (some micro-batches consumed, none in flight) the trainer still holds
            # st.version: its weights change only at the step's last micro-batch. Waiting for
            # the step to end instead deadlocks when that step's missing samples need a replica
            # that lacks st.version (a re-bound one, with max_staleness >= 1).
            if st.syncing or st.inflight or self.group_busy(st.location.group):
                continue
            hold = self.evals.hold(agent)
            if hold is not None and st.version > hold:
                continue                         # the replicas keep the version being evaluated
            targets = [r for r, b in zip(self.replicas, self.binding)
                       if b == agent and r.busy is None and r.held.get(agent) != st.version]
            if not targets:
                continue
            members = (st.leader,) + tuple(sorted(r.rank for r in targets))
            what = f"weight sync of agent {agent} v{st.version}"
            self.cmd(st.leader, messages.Sync(agent, st.version, members), what)
            for r in targets:
                self.cmd(r.rank, messages.Sync(agent, st.version, members), what)
                r.busy, r.syncing_to = "sync", (agent, st.version)
            st.syncing = True

    def dispatch_generation(self, agent: str, bound: dict[str, list[ReplicaState]] | None = None) -> None:
        """Send `agent`'s eligible pending requests to its replicas (`bound`: this round's
        agent -> bound replicas in replica order, when the caller has it)."""
        st = self.state[agent]
        ours = (bound.get(agent, ()) if bound is not None
                else [r for r, b in zip(self.replicas, self.binding) if b == agent])
        mine = [r for r in ours if (r.held.get(agent) == st.version and r.busy != "sync")
                or r.syncing_to == (agent, st.version)]
        if not any(r.free_for(agent, st.version) for r in mine):
            return
        eligible = [n for n in self.exp.pending[agent] if self.gate.may_generate(
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
            reqs = [self.exp.request(n, st.version) for n in nodes]
            bid = self.new_batch_id()
            self.batches[bid] = (r.rank, agent, st.version, nodes)
            self.cmd(r.rank, messages.Generate(bid, agent, st.version, reqs),
                     f"generate batch {bid} of agent {agent} ({len(reqs)} requests)")
            r.assigned(sum(self.exp.est_tokens(n) for n in nodes))
            sent.update(id(n) for n in nodes)
        if sent:
            self.exp.take_pending(agent, sent)

    def next_micro(self, agent: str) -> int:
        """Size of the micro-batch the scheduler would hand `agent`'s trainer now (0: none)."""
        st = self.state[agent]
        step = st.version
        if step >= self.cfg.run.steps:
            return 0
        complete = all(self.exp.ready_count(b, step) + self.state[b].consumed
                       == self.exp.batch_of(b, step) for b in self.agents if self.state[b].version == step)
        batch = self.exp.batch_of(agent, step)       # None: not known yet (episode workflows)
        remaining = UNKNOWN_BATCH if batch is None else batch - st.consumed
        return self.gate.micro_batch(self.exp.ready_count(agent, step), remaining,
                                      self.cfg.trainer.micro_batch_size, complete)

    def group_busy(self, g: int) -> bool:
        return self.moving[g] > 0 or any(
            s.location.group == g and (s.inflight or s.syncing) for s in self.state.values())

    def acquire_group(self, agent: str) -> None:
        """Agent-centric allocation: bind a parked agent with work to a trainer group, parking
        that group's resident agent if it sits at a step boundary with nothing to train."""
        st = self.state[agent]
        src = st.location
        # its own group first, then same-shape groups
        for g in swap_peers(self.trainer_groups, src.group):
            if self.group_busy(g) or (src.group != g and self.group_busy(src.group)):
                continue
            on_device, parked = Location(g, resident=True), Location(g, resident=False)
            resident = [other for other, s in self.state.items() if s.location == on_device]
            if resident:
                r = self.state[resident[0]]
                if r.consumed or r.inflight or r.syncing or self.next_micro(resident[0]):
                    continue
                self.send_move(resident[0], on_device, parked)
            self.send_move(agent, src, on_device)
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
        if self.evals.keeps(agent, st.version) and not any(
                r.held.get(agent) == st.version for r in self.replicas):
            return          # an evaluated version reaches a replica before it is trained past
        if not st.location.resident:
            if self.next_micro(agent):
                self.acquire_group(agent)
            return
        step = st.version
        while st.inflight < 2:
            k = self.next_micro(agent)
            batch = self.exp.batch_of(agent, step)
            if k == 0 and batch == 0 and not st.micro and step < self.cfg.run.steps:
                self.empty_step(agent, step)     # no episode of the step called this agent
                return
            if k == 0:
                return
            with self.clock("store"):            # CONSUMED flushed before the trainer sees them
                nodes = self.exp.take_ready(agent, step, k)
            st.consumed += len(nodes)
            st.micro += 1
            st.step_nodes.extend(nodes)
            last = st.consumed == batch
            self.cmd(st.leader, messages.Train(agent, step, pack(nodes, self.task),
                                               self.exp.loss_scale(agent, step), last),
                     f"train micro-batch {st.micro} of agent {agent} step {step}")
            st.inflight += 1

    def empty_step(self, agent: str, step: int) -> None:
        """A step without samples of `agent`: its trainer only moves to the next version
        (no optimizer step: Adam would move the weights on zero gradients)."""
        st = self.state[agent]
        st.micro += 1
        self.cmd(st.leader, messages.Train(agent, step, pack([], self.task), 0.0, True),
                 f"empty step {step} of agent {agent}")
        st.inflight += 1

    # -- messages --------------------------------------------------------------------------
    def cmd(self, rank: int, msg: messages.Command, what: str) -> None:
        """Send a command; `what` names it if the rank then stops answering."""
        self.transport.send(rank, msg)
        self.deadlines.sent(rank, what)

    # -- results -------------------------------------------------------------------------
    @booked("handle")
    def handle(self, src: int, msg: messages.Reply) -> None:
        if not isinstance(msg, messages.Intervals):
            self.deadlines.answered(src)
        if isinstance(msg, messages.Generated) and self.evals.owns(msg.batch_id):
            rank, lines = self.evals.generated(msg.batch_id, msg.outputs)
            self.replicas[rank - 1].done()
            for line in lines:
                self.log(line)
        elif isinstance(msg, messages.Generated):
            self.on_generated(src, msg)
        elif isinstance(msg, messages.Synced):
            self.replicas[msg.replica].synced(msg.agent, msg.version, msg.dropped)
        elif isinstance(msg, messages.TrainerSynced):
            self.state[msg.agent].syncing = False
        elif isinstance(msg, messages.SyncTimedOut):
            self.failures.sync_timed_out(src, msg)
        elif isinstance(msg, messages.Trained):
            self.state[msg.agent].inflight -= 1
        elif isinstance(msg, messages.Stepped):
            self.on_stepped(msg.agent, msg.version, msg.stats)
        elif isinstance(msg, messages.Checkpointed):
            self.ckpt_pending[src] -= 1
        elif isinstance(msg, messages.Moved):
            self.moving[self.layout.role_of(src)[1]] -= 1
        elif not isinstance(msg, (messages.Stopped, messages.Intervals)):
            raise RuntimeError(f"orchestrator: unknown reply {msg!r}")
        self.recorder.record_intervals(src, msg.intervals)

    def on_generated(self, src: int, msg: messages.Generated) -> None:
        rank, agent, version, nodes = self.batches.pop(msg.batch_id)
        self.replicas[rank - 1].done()
        # the replica's next batch, from what was already pending, goes out before this
        # one is recorded (the tree and the store take ~0.5 ms the replica would idle)
        self.dispatch_generation(agent)
        with self.clock("store"):   # rows are flushed with the next micro-batch's CONSUMED
            self.exp.record_generation([(n, t, lp) for n, (t, lp) in zip(nodes, msg.outputs)],
                                       version, rank - 1)
        self.recorder.tokens_since += sum(len(t) for t, _ in msg.outputs)

    def on_stepped(self, agent: str, version: int, stats: dict) -> None:
        nodes, n_micro = self.state[agent].finish_step(version)
        self.recorder.step_finished(agent, version, stats, nodes, n_micro)

    def flush_for_abort(self) -> None:
        """The steps' rows so far, no checkpoint, and the store flushed (a failure's abort)."""
        self.record_steps(checkpoints=False)
        self.recorder.flush()

    def record_steps(self, checkpoints: bool = True) -> None:
        """The /steps rows of the steps finished since the last call, and the checkpoints
        they make due. The main loop calls it after schedule(), so a finished step's weight
        syncs go out before its bookkeeping and before its checkpoint (which would hold the
        trainer for the checkpoint's duration); checkpoint() calls it before it commits."""
        finished = self.recorder.record_steps()
        due = self.ckpt_timer.due(finished) if checkpoints else []
        if due:
            self.checkpoint(due, wait=False)

    def maybe_log(self) -> None:
        """Log every global step all agents have finished (the main loop calls it after each
        schedule(); checkpoint() and stop_workers() before they act)."""
        done = min(s.version for s in self.state.values())
        if done > self.recorder.logged_step:
            with self.clock("log"):
                for line in self.recorder.log_steps(done):
                    self.log(line)

    # -- checkpoints and shutdown ----------------------------------------------------------
    def checkpoint(self, agents: list[str], wait: bool = True, only: bool = False) -> None:
        """Checkpoint `agents`; `wait` until every group asked (`only`: these agents' groups
        alone; a failed worker may hold the others forever) has answered."""
        self.record_steps(checkpoints=False)
        self.maybe_log()                # a resume starts logging at the checkpoint's steps
        with self.clock("store"):
            self.store.flush()          # committed before a checkpoint can hold a version
        by_group = defaultdict(list)
        for agent in agents:
            by_group[self.state[agent].leader].append(agent)
        for leader, names in by_group.items():
            self.cmd(leader, messages.Checkpoint(names), f"checkpoint of {', '.join(names)}")
            self.ckpt_pending[leader] += 1
        while wait and any(n for lead, n in self.ckpt_pending.items() if not only or lead in by_group):
            self.handle(*self.failures.receive())
        self.store.flush()

    def drain(self) -> None:
        """Wait until no generation, training or sync is in flight."""
        while (self.batches or self.evals.batches or any(r.busy for r in self.replicas)
               or any(s.inflight or s.syncing for s in self.state.values()) or any(self.ckpt_pending.values())
               or any(self.moving.values())):
            self.handle(*self.failures.receive())

    def stop_workers(self, code: int) -> None:
        self.drain()
        targets = ([r.rank for r in self.replicas] + [self.layout.group_leader(g) for g in range(self.layout.groups)]
                   + self.layout.tool_rank_list)
        for rank in targets:
            self.cmd(rank, messages.Stop(code), "stop")
        # every worker rank answers "stopped" last (group members too: the leader forwards
        # the stop), so once all have, no interval message is left in flight
        pending = self.layout.world_size - 1
        while pending:
            src, msg = self.failures.receive()
            self.handle(src, msg)
            pending -= isinstance(msg, messages.Stopped)
        self.record_steps(checkpoints=False)
        self.maybe_log()
        self.exp.close()
        self.evals.close()
        self.recorder.flush()
        self.recorder.close()
