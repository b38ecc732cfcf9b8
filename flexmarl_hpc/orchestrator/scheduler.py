"""The scheduler: pure policy, no MPI, no clock. The orchestrator and the simulator both
ask it the same questions with plain data and act on its answers.

Level 1 (inter-agent): how much replica time each agent gets, from its backlog of
estimated tokens. With what the orchestrator knows at batch boundaries (which replicas are
idle, which agents each could serve now) it is time-sharing (`timeshare`): a replica that
finishes a batch goes to the agent with the most backlog per replica, so with fewer
replicas than agents, or one agent's backlog dominating, replicas are not pinned 1:1.
Without that (`rebind(backlog, binding)` alone) it re-binds whole replicas only when the
backlog share and the replica share of some agent differ by more than
`rebalance_threshold` and `rebalance_cooldown` rounds have passed since the last
re-binding (hysteresis), or when an agent with work has no replica at all.
Level 2 (intra-agent): each request goes to the replica of its agent with the least
outstanding work, so the samples of one prompt may be spread over several replicas.
Gating: when may a step start, when may a request be generated at a version, when does
a trainer get a micro-batch; `sync` mode adds the barriers of the baseline.

Two objects, one job each: a `Binder` per rollout pool (level 1 over its replicas;
pool_binding.py holds one per pool) and the run's one `Gate`; level 2 is `route`.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from flexmarl_hpc.config.resources import steps_in_flight


def allocate(backlog: dict[str, float], n: int) -> dict[str, int]:
    """Replicas per agent, proportional to backlog (largest remainder).

    Every agent with work gets at least one replica while replicas last (most backlog
    first); agents without work get none unless there is no work at all (even split).
    """
    agents = list(backlog)
    active = sorted((agent for agent in agents if backlog[agent] > 0), key=lambda agent: -backlog[agent])
    if not active:
        return {agent: n // len(agents) + (i < n % len(agents)) for i, agent in enumerate(agents)}
    counts = {agent: 0 for agent in agents}
    if n <= len(active):
        for agent in active[:n]:
            counts[agent] = 1
        return counts
    for agent in active:
        counts[agent] = 1
    spare = n - len(active)
    total = sum(backlog[agent] for agent in active)
    quota = {agent: spare * backlog[agent] / total for agent in active}
    for agent in active:
        counts[agent] += int(quota[agent])
    left = n - sum(counts.values())
    for agent in sorted(active, key=lambda agent: -(quota[agent] - int(quota[agent])))[:left]:
        counts[agent] += 1
    return counts


def assign(counts: dict[str, int], current: list[str | None],
           servable: list[set[str]] | None = None) -> list[str]:
    """Replica -> agent with the given counts, moving as few replicas as possible.

    `servable[r]` (None: any agent): the agents replica r may move to now. A replica over
    its agent's count that can serve none of the agents still short keeps its agent, so the
    counts are then only approached; a replica is never taken off an agent for being
    unservable, only moved onto one that is servable."""
    n = len(current)
    out: list[str | None] = [None] * n
    need = dict(counts)
    for r, agent in enumerate(current):
        if agent is not None and need.get(agent, 0) > 0:
            out[r] = agent
            need[agent] -= 1
    todo = [agent for agent, k in need.items() for _ in range(k)]
    for r in range(n):
        if out[r] is None:
            i = next((i for i, agent in enumerate(todo) if servable is None or agent in servable[r]), None)
            out[r] = current[r] if i is None else todo.pop(i)
    return out


def disparity(backlog: dict[str, float], binding: list[str]) -> float:
    """max over agents of |backlog share - replica share|."""
    total = sum(backlog.values())
    if total <= 0:
        return 0.0
    n = len(binding)
    return max(abs(backlog[agent] / total - binding.count(agent) / n) for agent in backlog)


def timeshare(backlog: dict[str, float], binding: list[str], idle: list[bool],
              servable: list[set[str]]) -> list[str]:
    """Replica time in proportion to backlog, decided at batch boundaries: busy replicas
    keep their agent; each idle replica in turn goes to the agent with the largest backlog
    per replica serving it (busy ones and those assigned before: the D'Hondt rule) among
    those with backlog it can serve now (`servable[r]`: it holds their current weights, or
    they can be synced to it now). Ties keep the replica's agent (no needless sync); with
    no servable backlog it keeps its agent. Every agent keeps progressing: an agent with
    backlog and no replica bids its whole backlog, and a served agent's bid falls as its
    backlog is dispatched, so it wins a replica within finitely many batches."""
    out = list(binding)
    serving = {agent: 0 for agent in backlog}
    for agent, i in zip(binding, idle):
        if not i:
            serving[agent] = serving.get(agent, 0) + 1
    for r in (r for r, i in enumerate(idle) if i):
        bids = [agent for agent in servable[r] if backlog.get(agent, 0) > 0]
        if not bids:
            continue
        best = max(bids, key=lambda agent: (backlog[agent] / (serving[agent] + 1), agent == binding[r], agent))
        out[r] = best
        serving[best] += 1
    return out


def route(requests: list[float], outstanding: dict[int, float]) -> dict[int, list[int]]:
    """Level 2: assign each request (estimated tokens, in order) to the replica with the
    least outstanding work, counting what was assigned before it. Returns replica -> request
    indices."""
    heap = [(w, r) for r, w in outstanding.items()]
    heapq.heapify(heap)
    out: dict[int, list[int]] = {r: [] for r in outstanding}
    for i, est in enumerate(requests):
        w, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (w + est, r))
    return out


def one_at_a_time(backlog: dict[str, float], binding: list[str], idle: list[bool]) -> list[str] | None:
    """`pipeline.one_agent_at_a_time`: all replicas to the agent with the most backlog, once
    the agent they serve has nothing pending and every replica is idle (None: keep)."""
    if not all(idle):
        return None
    current = binding[0] if len(set(binding)) == 1 else None
    if current is not None and backlog.get(current, 0.0) > 0:
        return None
    waiting = {agent: b for agent, b in backlog.items() if b > 0}
    if not waiting:
        return None
    new = [max(waiting, key=waiting.get)] * len(binding)
    return None if new == binding else new


@dataclass
class Binder:
    """Level 1 over one pool's replicas: which agent each serves (`rebind`, once a round)."""
    agents: list[str]
    num_replicas: int
    mode: str                       # "sync" | "flex"
    load_balance: bool = True
    threshold: float = 0.5
    cooldown: int = 4
    one_agent: bool = False
    rounds_since_rebind: int = 1 << 30

    @classmethod
    def for_run(cls, cfg, agents: list[str], replicas: int) -> "Binder":
        """The binder of `replicas` replicas serving `agents`, with the run's mode and
        pipeline settings (`cfg`: a config.schema.Config)."""
        p = cfg.pipeline
        return cls(list(agents), replicas, cfg.run.mode, p.load_balance, p.rebalance_threshold,
                   p.rebalance_cooldown, p.one_agent_at_a_time)

    def initial_binding(self) -> list[str]:
        return assign(allocate({agent: 0.0 for agent in self.agents}, self.num_replicas),
                      [None] * self.num_replicas)

    def rebind(self, backlog: dict[str, float], binding: list[str], idle: list[bool] | None = None,
               servable: list[set[str]] | None = None) -> list[str] | None:
        """A new replica -> agent binding, or None to keep the current one. Call once a round.
        flex with load balancing, `idle`/`servable` given (the orchestrator) and fewer replicas
        than agents: `timeshare`. With a replica per agent available, the backlog-proportional
        allocation below keeps bindings stable: time-sharing there re-syncs every version to
        every replica, on the trainer leader's critical path (bench_modes, referential: flex
        fell to 0.92x of sync with it, from 1.27x without).

        That allocation moves a replica only onto an agent in its `servable` set (issue 37:
        with trainer groups shared by several agents, replicas were moved to a parked agent
        whose group trained another one; push_weights cannot sync it then, so they idled).
        It never takes a replica off an agent for being unservable (a training agent keeps its
        replicas, at one agent a group too), and the counts keep every waiting agent's backlog.
        No starvation: a parked agent with backlog is servable in every round its group is
        free (no agent of it training or syncing, no move), which happens at least at each
        step boundary of the resident agent (its next step's samples need that step's weights
        first: with max_staleness 0 it cannot train across the boundary) and whenever the
        resident has nothing to train. In that round it counts as starving, which skips the
        cooldown, so it gets a replica, and push_weights syncs it in the same round; from
        then on allocate keeps it at least one replica while it has backlog, and its samples
        make it acquire the group. Blocking every parked agent instead deadlocks: it never
        gets samples, so it never has the training work that makes it resident."""
        self.rounds_since_rebind += 1
        if self.one_agent and idle is not None:
            return one_at_a_time(backlog, binding, idle)
        starving = any(backlog[agent] > 0 and agent not in binding for agent in self.agents)
        if (self.mode == "flex" and self.load_balance and idle is not None and servable is not None
                and len(self.agents) > self.num_replicas):
            new = timeshare(backlog, binding, idle, servable)
        elif self.mode == "sync" or not self.load_balance:
            if not starving:
                return None
            static = self.initial_binding()
            if not any(backlog[agent] > 0 and agent not in static for agent in self.agents):
                new = static
            else:                          # fewer replicas than agents: serve who has work
                new = assign(allocate(backlog, self.num_replicas), binding)
        else:
            # a starving agent no replica can serve now skips no cooldown: nothing may move to
            # it yet, and the skip would only churn the other agents' replicas
            reachable = set().union(*servable) if servable is not None else set(self.agents)
            starving = any(backlog[agent] > 0 and agent not in binding for agent in reachable)
            if not starving and (self.rounds_since_rebind < self.cooldown
                                 or disparity(backlog, binding) <= self.threshold):
                return None
            new = assign(allocate(backlog, self.num_replicas), binding, servable)
        if new == binding:
            return None
        self.rounds_since_rebind = 0
        return new

    @property
    def wants_servable(self) -> bool:
        """Does `rebind` read its `servable` argument? Only flex with load balancing: the
        orchestrator skips building it otherwise (a set per replica per round)."""
        return self.mode == "flex" and self.load_balance and not self.one_agent


@dataclass(frozen=True)
class Gate:
    """What may happen now: a step's roots made (`may_admit`), a request sampled at a version
    (`may_generate`), a micro-batch handed to a trainer (`micro_batch`); `sync` adds the
    baseline's barriers."""
    mode: str                       # "sync" | "flex"
    max_staleness: int = 0
    overlap: bool = True

    @classmethod
    def for_run(cls, cfg) -> "Gate":
        return cls(cfg.run.mode, cfg.pipeline.max_staleness, cfg.pipeline.micro_batch_overlap)

    def may_admit(self, step: int, versions: dict[str, int], synced: bool) -> bool:
        """May the roots of `step` be created? sync: only once every agent is at `step`
        and the replicas hold it. flex: once some agent may sample it (within
        max_staleness of its version), inside the window of steps in flight from the slowest
        agent's step (config.resources.steps_in_flight: one step beyond that agent's
        staleness). An agent that finished its step samples its part of the next one while a
        slower agent still trains; may_generate keeps each request at its own agent's
        version, so the samples (and the weights) are the same as without the lookahead."""
        if self.mode == "sync":
            return all(v == step for v in versions.values()) and synced
        return step <= max(versions.values()) + self.max_staleness and \
            step < min(versions.values()) + steps_in_flight(self.max_staleness)

    def may_generate(self, step: int, version: int, prev_turn_left: int) -> bool:
        """May a request of `step` be sampled with weights of `version`? (sync also waits for
        the previous turn of the step to finish: the per-turn barrier of the baseline)."""
        if not step - self.max_staleness <= version <= step:
            return False
        return self.mode != "sync" or prev_turn_left == 0

    def micro_batch(self, ready: int, remaining: int, micro: int, step_complete_everywhere: bool) -> int:
        """How many ready samples to hand the trainer now (0: wait).

        flex: a full micro-batch as soon as there is one, or the last partial one of the
        global batch. sync: nothing until every agent's whole step is ready."""
        if remaining <= 0 or ready <= 0:
            return 0
        if self.mode == "sync" and not step_complete_everywhere:
            return 0
        if not self.overlap and ready < remaining:      # ablation: whole batch first
            return 0
        take = min(micro, remaining)
        return take if ready >= take else 0
