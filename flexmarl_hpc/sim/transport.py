"""A discrete-event transport: the real Orchestrator drives simulated workers on a simulated
clock. Nothing sleeps; `receive` jumps the clock to the next reply.

A command's reply is made of two independent parts:
- its content, from `SyntheticWorkers` (responses of modelled length, made of tokens the
  task allows, so the real workflow computes real rewards; training compute skipped), or
  from `sim.inprocess.InProcessWorkers` (the real engine and trainers, for small models:
  the run then equals an MPI run), or any object with the same four methods;
- its timing, from a `CostModel` (seconds of each operation) and the workers' queues: a
  worker runs its commands in arrival order, one at a time, as a real rank does, and a
  weight broadcast or a state move starts once every member has reached it (rendezvous).

Replies carry (activity, agent, t0, t1) intervals in simulated seconds from `t0` (the
store's start, so the timeline lines up), and each trainer group member reports its own, as
real ranks do. With `charge_orchestrator`, the orchestrator's own real compute time
between two receives is added to the clock: zero-cost workers then measure how much the
single orchestrator rank can drive.

Three modelled costs, all 0 unless a profile sets them (a calibrated CPU profile does, see
sim/calibrate.py): `orchestrator_s` per reply handled and `orchestrator_step_s` per optimizer
step (the orchestrator's own time, on the clock before it sends again); `latency_s`, one way,
on every command and reply; `shared_cores`: when ranks outnumber cores, generate and train
commands and the orchestrator's own time share them (processor sharing, sim/cores.py: while ranks computing w in all
run, each gets min(1, cores / (w + waiting_share x the ranks polling)) of a core once they
fill the cores, and every start or end re-times the others); a
rank's later commands then wait in `deferred` until its running command has ended.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field, replace
from typing import Protocol, Sequence

import numpy as np

from flexmarl_hpc.clock import SimulatedClock
from flexmarl_hpc.runtime import messages
from flexmarl_hpc.config.layout import ROLLOUT, RankLayout
from flexmarl_hpc.sim.cores import CoreShare, Job


SMALL_MESSAGE_BYTES = 64
"""Bytes of a command or reply beyond its token payload (pickled header, ids)."""
PROMPT_TOKEN_BYTES = 8
"""A prompt token in a Generate command (a Python int pickled, about 5-9 bytes)."""
RESPONSE_TOKEN_BYTES = 12
"""A response token in a Generated reply: its id and its float log-prob."""


class CostModel(Protocol):
    """Seconds each operation takes on the modelled hardware (sim.costs.CostModel is one)."""

    def generate_s(self, agent: str, n_prompts: int, prompt_tokens: Sequence[int],
                   response_tokens: Sequence[int]) -> float:
        """One replica batch of `n_prompts` requests: each one's prompt and response length."""

    def train_s(self, agent: str, tokens: int, optimizer_step: bool = True) -> float:
        """Forward + backward of one micro-batch of `tokens` (prompt + response) tokens on a
        trainer group, plus the optimizer step on a step's last micro-batch."""

    def sync_s(self, agent: str, nbytes: float) -> float:
        """Broadcast of `nbytes` of weights from a trainer leader to the replicas."""

    def swap_s(self, agent: str, nbytes: float) -> float:
        """Moving `nbytes` of training state (park, unpark or between groups)."""

    def weight_bytes(self, agent: str) -> int:
        """What a weight sync of `agent` moves."""

    def state_bytes(self, agent: str) -> int:
        """What a state move of `agent` moves."""


@dataclass(frozen=True)
class ConstantCost:
    """Fixed seconds per operation (zero by default): for tests and the orchestrator's
    own throughput limit."""
    generate: float = 0.0
    train: float = 0.0
    optimizer: float = 0.0
    sync: float = 0.0
    swap: float = 0.0

    def generate_s(self, agent, n_prompts, prompt_tokens, response_tokens) -> float:
        return self.generate

    def train_s(self, agent, tokens, optimizer_step=True) -> float:
        return self.train + (self.optimizer if optimizer_step else 0.0)

    def sync_s(self, agent, nbytes) -> float:
        return self.sync

    def swap_s(self, agent, nbytes) -> float:
        return self.swap

    def weight_bytes(self, agent) -> int:
        return 0

    def state_bytes(self, agent) -> int:
        return 0


class SyntheticWorkers:
    """Reply content without models: each response has `response_len(agent, turn, budget)`
    tokens (default: the whole budget) drawn, seeded by the request's seed, from the tokens
    the task allows at that turn; log-probs are those of a uniform policy. Training returns
    no statistics (the store records zeros). An episode workflow's task names `filler_ids`
    (workflows/episode_task.py): replies are drawn from those, never a stop token, so a chat
    reply is filler text exactly as long as the max_tokens its episode asked for."""

    def __init__(self, task, response_len=None) -> None:
        self.task = task
        self.response_len = response_len or (lambda agent, turn, budget: budget)
        self._ids: dict[int, np.ndarray] = {}
        self._filler: tuple | None = None

    def generate(self, cmd: messages.Generate) -> list[tuple[list[int], list[float]]]:
        out = []
        for sample_id, prompt, seed, budget, turn in cmd.requests:
            ids = self._allowed(turn)
            n = max(0, min(budget, int(self.response_len(cmd.agent, turn, budget))))
            toks = np.random.default_rng(seed).choice(ids, size=n).tolist()
            out.append((toks, [-float(np.log(len(ids)))] * n))
        return out

    def train(self, cmd: messages.Train) -> dict[str, float]:
        return {}

    def sync(self, cmd: messages.Sync) -> None:
        pass

    def checkpoint(self, cmd: messages.Checkpoint) -> None:
        pass

    def _allowed(self, turn: int) -> np.ndarray:
        filler = getattr(self.task, "filler_ids", None)
        if filler is not None:                   # converted once, not per request
            if self._filler is None or self._filler[0] is not filler:
                self._filler = (filler, np.asarray(filler))
            return self._filler[1]
        if turn not in self._ids:
            mask = self.task.allowed_tokens(turn)
            self._ids[turn] = (np.arange(len(self.task.vocab)) if mask is None
                               else np.nonzero(np.asarray(mask))[0])
        return self._ids[turn]


@dataclass
class _Meeting:
    """A collective (weight broadcast, state move) waiting for its members' commands."""
    members: tuple[int, ...]
    arrived: dict[int, float] = field(default_factory=dict)    # rank -> when it is free for it
    replies: dict[int, messages.Reply] = field(default_factory=dict)  # rank -> its reply, once done


class SimTransport:
    """The orchestrator's Transport, on a simulated clock (`now`, seconds since the epoch
    like time.time(), starting at `t0`; `clock` reads it, for the run's other parts)."""

    def __init__(self, layout: RankLayout, cost: CostModel, workers, t0: float | None = None,
                 charge_orchestrator: bool = False, orchestrator_s: float = 0.0,
                 orchestrator_step_s: float = 0.0, latency_s: float = 0.0,
                 shared_cores: float = 0, waiting_share: float = 0.0, workers_poll: bool = True,
                 network=None, perturb=None, orchestrator_byte_s: float = 0.0) -> None:
        self.layout, self.cost, self.workers = layout, cost, workers
        self.now = time.time() if t0 is None else t0
        self.clock = SimulatedClock(self)            # the run's clock: pass it to StoreFile and Orchestrator
        self.free_at: dict[int, float] = {}          # worker rank -> end of its last command
        self.events: list[tuple[float, int, int, messages.Reply]] = []     # (t, seq, src, reply)
        self.seq = 0
        self.meetings: dict[tuple, _Meeting] = {}
        self.charge = charge_orchestrator
        self._real = time.perf_counter()
        self.sent = 0                                # commands handled (for throughput figures)
        self.orchestrator_s = orchestrator_s         # modelled seconds per reply handled
        self.orchestrator_step_s = orchestrator_step_s   # ... and per optimizer step (Stepped)
        self.latency_s = latency_s                   # one-way, each command and reply
        # > 0: generate and train share that many cores (processor sharing, sim/cores.py);
        # a rank computing or held in a collective keeps later commands in `deferred`
        self.share = (CoreShare(shared_cores, self.now, layout.world_size, waiting_share, workers_poll)
                      if shared_cores else None)
        self.computing: set[int] = set()
        self.deferred: dict[int, list[tuple[float, tuple]]] = {}
        # weight syncs as flows over a shared fabric (sim.placement.SyncNetwork), else a
        # fixed time each; seeded jitter/stragglers (sim.perturb.Perturber); message bytes
        self.net, self.perturb, self.byte_s = network, perturb, orchestrator_byte_s
        if network is not None:
            network.share.t = self.now
        self.reply_bytes: dict[int, float] = {}      # batch_id -> bytes of its Generated reply
        self.cmd_bytes = 0.0                         # bytes of the command being planned
        self.orchestrator_charged = 0.0              # modelled seconds of the orchestrator's own work

    # -- Transport ------------------------------------------------------------------------
    def send(self, rank: int, msg: messages.Command) -> None:
        self._tick()
        self._settle(self.now)
        self.sent += 1
        self.cmd_bytes = SMALL_MESSAGE_BYTES
        plan = self._plan(rank, msg)                 # the reply's content is made now, in send order
        self.now += self.byte_s * self.cmd_bytes     # the orchestrator serializes it before it goes
        self.orchestrator_charged += self.byte_s * self.cmd_bytes
        arrival = self.now + self.latency_s
        # a command to a rank still held in a collective (a generate queued behind its
        # weight sync) waits for it, as it does behind a computing rank on shared cores
        if (rank in self.computing or self.deferred.get(rank)
                or self.free_at.get(rank, 0.0) == float("inf")):
            self.deferred.setdefault(rank, []).append((arrival, plan))
            return
        self._start(rank, plan, arrival)

    def receive(self, timeout: float | None = None) -> tuple[int, messages.Reply]:
        self._tick()
        while True:                                  # complete the jobs that end before the next reply
            end = min((s.next_end() for s in self._shares()), default=float("inf"))
            if end == float("inf") or (self.events and self.events[0][0] <= end):
                break
            self._settle(end)
        if not self.events:
            # simulated workers never hang: an empty queue is a protocol error, not a wait
            raise RuntimeError("simulation: the orchestrator waits for a reply but no command is in flight")
        t, _, src, reply = heapq.heappop(self.events)
        self.now = max(self.now, t)
        self._orchestrate(reply)
        self._real = time.perf_counter()
        return src, reply

    def poll(self) -> tuple[int, messages.Reply] | None:
        self._tick()
        self._settle(self.now)
        if self.events and self.events[0][0] <= self.now:
            _, _, src, reply = heapq.heappop(self.events)
            self._orchestrate(reply)
            return src, reply
        return None

    def abort(self, code: int) -> None:
        raise SystemExit(code)

    # -- the simulated workers ---------------------------------------------------------------
    def _plan(self, rank: int, msg: messages.Command) -> tuple:
        """What `rank` will do for `msg`: its content (the workers' answer) and duration."""
        role, index = self.layout.role_of(rank)
        if isinstance(msg, messages.Generate):
            outputs = self.workers.generate(msg)
            prompts, lengths = [len(r[1]) for r in msg.requests], [len(t) for t, _ in outputs]
            dt = self.cost.generate_s(msg.agent, len(msg.requests), prompts, lengths) * self._factor(rank)
            # a modelled cost says what the request stands for (sim.driver.ModelledCost)
            p_tok, r_tok = getattr(self.cost, "last_tokens", (sum(prompts), sum(lengths)))
            self.cmd_bytes = PROMPT_TOKEN_BYTES * p_tok + SMALL_MESSAGE_BYTES * len(prompts)
            self.reply_bytes[msg.batch_id] = RESPONSE_TOKEN_BYTES * r_tok + SMALL_MESSAGE_BYTES * len(lengths)
            return ("run", dt, "generate", msg.agent, messages.Generated(msg.batch_id, outputs))
        if isinstance(msg, messages.Train):
            stats = self.workers.train(msg)
            arrays = msg.arrays
            # a cost may price modelled rather than real tokens (sim.driver.ModelledCost)
            real = int(np.sum(arrays["prompt_lens"]) + np.sum(arrays["response_lens"]))
            tokens = self.cost.train_tokens(arrays, msg.agent) if hasattr(self.cost, "train_tokens") else real
            dt = self.cost.train_s(msg.agent, tokens, optimizer_step=msg.last) * self._factor(rank)
            # the micro-batch's arrays, scaled from the real tokens to the modelled ones
            self.cmd_bytes = sum(np.asarray(a).nbytes for a in arrays.values()) * tokens / max(real, 1)
            reply = messages.Stepped(msg.agent, msg.step + 1, stats) if msg.last else messages.Trained(msg.agent, msg.step)
            return ("run", dt, "train", msg.agent, reply)
        if isinstance(msg, messages.Sync):
            if rank == msg.members[0]:
                self.workers.sync(msg)               # the leader's weights at the broadcast
            dt = self.cost.sync_s(msg.agent, self.cost.weight_bytes(msg.agent))
            reply = (messages.Synced(index, msg.agent, msg.version) if role == ROLLOUT
                     else messages.TrainerSynced(msg.agent, msg.version))
            return ("meet", ("sync", msg.agent, msg.version, msg.members), msg.members, dt, "sync", msg.agent, reply)
        if isinstance(msg, messages.Move):
            leaders = tuple(sorted({self.layout.group_leader(g) for g in (msg.src.group, msg.dst.group)}))
            dt = self.cost.swap_s(msg.agent, self.cost.state_bytes(msg.agent)) * self._factor(rank)
            return ("meet", ("move", msg.agent, msg.src, msg.dst), leaders, dt, "swap", msg.agent, messages.Moved(msg.agent))
        if isinstance(msg, messages.Checkpoint):
            self.workers.checkpoint(msg)
            return ("run", 0.0, "checkpoint", ",".join(msg.agents), messages.Checkpointed(msg.agents))
        if isinstance(msg, messages.Stop):
            return ("stop", [rank] if role == ROLLOUT else self.layout.group_ranks(index),
                    messages.Stopped(index if role == ROLLOUT else -1))
        raise ValueError(f"simulated worker {rank}: unknown command {msg.kind!r}")

    def _start(self, rank: int, plan: tuple, arrival: float) -> None:
        """`rank` takes up `plan` once it has arrived and the rank is free."""
        start = max(arrival, self.free_at.get(rank, arrival))
        if start == float("inf"):
            raise RuntimeError(f"simulation: rank {rank} got {plan[0]!r} while it waits in a collective")
        if plan[0] == "run":
            self._run(rank, start, *plan[1:])
        elif plan[0] == "meet":
            self._meet(plan[1], plan[2], rank, start, *plan[3:])
        else:
            for r in plan[1]:
                self._reply(start, r, plan[2])

    def _factor(self, rank: int) -> float:
        """The seeded jitter/straggler factor of `rank`'s next operation (1 without)."""
        return self.perturb.factor(rank) if self.perturb is not None else 1.0

    def _handling(self, reply: messages.Reply) -> float:
        """Modelled orchestrator seconds (at a whole core) to handle `reply`: per reply, per
        optimizer step, and per byte it reads."""
        nbytes = (self.reply_bytes.pop(reply.batch_id, SMALL_MESSAGE_BYTES)
                  if isinstance(reply, messages.Generated) else SMALL_MESSAGE_BYTES)
        return (self.orchestrator_s + self.byte_s * nbytes
                + (self.orchestrator_step_s if isinstance(reply, messages.Stepped) else 0.0))

    def _orchestrate(self, reply: messages.Reply) -> None:
        """The orchestrator handles `reply`: its modelled seconds pass on the clock. On shared
        cores it computes there like a worker (rank 0 is busy 25-30% of a referential run,
        while the workers compute): it takes its share of a core, and slows them meanwhile;
        the jobs that end while it works send their replies then."""
        h = self._handling(reply)
        self.orchestrator_charged += h
        if not (self.share and h > 0):
            self.now += h
            return
        self._settle(self.now)
        me = Job(0, self.now, h, 1, None)
        self.share.add(me)
        while me in self.share.jobs:
            for at, job in self.share.advance(self.share.next_end()):
                if job is me:
                    self.now = at
                else:
                    self._job_ended(at, job)

    def _tick(self) -> None:
        """Charge the orchestrator's real compute since the last call to the clock."""
        if self.charge:
            t = time.perf_counter()
            self.now += t - self._real
            self._real = t

    def _shares(self) -> list:
        """The shared resources in use: the cores (CoreShare), the fabric (FlowShare)."""
        return [s for s in (self.share, self.net.share if self.net else None) if s is not None]

    def _settle(self, t: float) -> None:
        """Complete the shared-core jobs and network flows that end by `t` (their replies queue)."""
        # one completion time at a time, the earliest first: what a completion frees may
        # start a job right then, on either resource
        while True:
            end, s = min(((s.next_end(), i) for i, s in enumerate(self._shares())), default=(float("inf"), -1))
            if end > t:
                break
            share = self._shares()[s]
            for at, job in share.advance(end):
                if share is self.share:
                    self._job_ended(at, job)
                else:
                    self._flow_ended(at, job)
        for share in self._shares():
            share.advance(max(t, share.t))

    def _flow_ended(self, at: float, flow) -> None:
        """A weight broadcast's bytes have all arrived: every member replies."""
        begin, agent, replies = flow.payload
        for r in flow.key:
            self._done(r, begin, at, "sync", agent, replies[r])

    def _job_ended(self, at: float, job: Job) -> None:
        """A worker's shared-core job ended at `at`: its rank is free, its reply goes out."""
        self.computing.discard(job.key)
        self._done(job.key, job.start, at, *job.payload)

    def _run(self, rank: int, start: float, dt: float, activity: str, agent: str, reply: messages.Reply) -> None:
        """`rank` (a replica or a group leader) runs one command from `start` for `dt`
        (on shared cores a generate or train takes as long as its share of them makes it)."""
        if self.share and activity in ("generate", "train") and dt > 0:
            role, index = self.layout.role_of(rank)
            weight = 1 if role == ROLLOUT else len(self.layout.group_ranks(index))
            self.computing.add(rank)
            self.free_at[rank] = float("inf")
            self.share.add(Job(rank, start, dt, weight, (activity, agent, reply)))
            return
        self._done(rank, start, start + dt, activity, agent, reply)

    def _done(self, rank: int, start: float, end: float, activity: str, agent: str, reply: messages.Reply) -> None:
        self.free_at[rank] = end
        self._reply(end, rank, _with(reply, activity, agent, start, end))
        role, index = self.layout.role_of(rank)
        if role != ROLLOUT and activity != "sync":          # the members work alongside
            for r in self.layout.group_ranks(index)[1:]:
                self._reply(end, r, messages.Intervals(intervals=[(activity, agent, start, end)]))
        self._resume(rank)

    def _resume(self, rank: int) -> None:
        """Start what waited for `rank` (shared cores), in arrival order, while it is free."""
        queue = self.deferred.get(rank)
        while queue and rank not in self.computing and self.free_at.get(rank, 0.0) != float("inf"):
            arrival, plan = queue.pop(0)
            self._start(rank, plan, arrival)

    def _meet(self, key: tuple, members: tuple[int, ...], rank: int, start: float, dt: float,
              activity: str, agent: str, reply: messages.Reply) -> None:
        """A collective: each member's reply comes when all have arrived, plus `dt`."""
        m = self.meetings.setdefault(key, _Meeting(members))
        m.arrived[rank], m.replies[rank] = start, reply
        self.free_at[rank] = float("inf")           # held until the others arrive
        if len(m.arrived) < len(m.members):
            return
        del self.meetings[key]
        begin = max(m.arrived.values())
        if activity == "sync" and self.net is not None:    # a flow on the shared fabric
            self.net.start(begin, m.members, self.cost.weight_bytes(agent), (begin, agent, m.replies))
            return
        for r in m.members:
            self._run(r, begin, dt, activity, agent, m.replies[r])

    def _reply(self, t: float, src: int, reply: messages.Reply) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t + self.latency_s, self.seq, src, reply))


def _with(reply: messages.Reply, activity: str, agent: str, t0: float, t1: float) -> messages.Reply:
    return replace(reply, intervals=[(activity, agent, t0, t1)])
