"""The workflow trees of live steps: pure bookkeeping, no I/O (experience.py journals it).

Each root input of step s grows a tree: turn t's agent answers every path of turn t-1
`samples[t]` times. A node is one sample with sample_id = {input_id}_{turn}_{trajectory_id}.
Its life:

    pending  -> (dispatched to a replica) -> GENERATED
             -> READY     once its reward (mean of the leaves below it) and those of its
                          siblings are known, so the group advantage can be computed
             -> CONSUMED  when handed to its agent's trainer
             -> DROPPED   (pipeline.overprovision only) its input was not among the first
                          inputs_per_step of its step to finish; never trained

Over-provisioning: a step admits inputs_per_step + overprovision inputs; an input joins the
step's batch when its whole tree is generated (its READY samples wait until then), and once
inputs_per_step have joined, the step's other inputs are dropped, whatever state they are
in (pending, on a replica, generated). Which inputs win depends on timing, so such a run is
not reproducible sample for sample; every generated sample is still trained once or dropped.

Every method that changes statuses returns a `Changes`: what the journal must record.
"""
from __future__ import annotations

import math
from functools import cached_property
from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from flexmarl_hpc.config.schema import Config
from flexmarl_hpc.store.checksum import StoreInconsistent
from flexmarl_hpc.store.schema import CONSUMED, DROPPED, GENERATED, READY
from flexmarl_hpc.workflows.base import Path, Task


@dataclass(eq=False)
class Node:
    agent: str
    turn: int
    step: int
    input_id: int
    traj: int
    parent: "Node | None"
    group: "list[Node]"               # siblings incl. self (same parent, same prompt)
    root_input: object
    children: list = field(default_factory=list)
    prompt: list[int] | None = None
    response: list[int] | None = None
    logprobs: list[float] | None = None
    version: int = -1
    replica: int = -1
    status: int = -1                   # -1 pending, then GENERATED / READY / CONSUMED / DROPPED
    reward: float | None = None
    advantage: float = 0.0
    leaf_sum: float = 0.0
    leaf_n: int = 0
    row: int = -1                      # its row in the journal (set by the journal)
    trainer_step: int = -1
    parent_call: str = ""              # episode workflows: "agent/sample_id" of the call before
    journalled: int = -1               # the last status the journal recorded (experience.py)
    retokenized: int = 0               # episode calls: the prompt tokenised fresh from a history
    prefill_len: int = 0               # episode calls: the prompt's last ids a forced prefill

    @cached_property                   # asked for often (journal, seeds, keys); never changes
    def sample_id(self) -> str:
        return f"{self.input_id}_{self.turn}_{self.traj}"

    def path(self) -> Path:
        return Path.to(self)


@dataclass
class Changes:
    """Status changes for the journal, in the order to record them (a node made ready can
    be dropped by the same batch)."""
    generated: list[Node] = field(default_factory=list)
    ready: list[Node] = field(default_factory=list)
    dropped: list[Node] = field(default_factory=list)     # generated nodes now DROPPED


class NodeQueues:
    """The per-agent queues both kinds of workflow keep (Tree here, episodes.EpisodeTree):
    `pending` nodes for the replicas, `ready` nodes by step for the trainers, and the mean
    response length each backlog estimate uses. Subclasses fill them."""
    cfg: Config
    pending: dict[str, deque[Node]]
    ready: dict[str, dict[int, list[Node]]]
    resp_len_mean: dict[str, float]
    lost_inputs: dict[int, set[int]] = {}
    """step -> inputs a resume cannot sample again (Tree._find_lost); never written here."""
    failures = None
    """Episode workflows: their failed episodes (episode_failures.EpisodeFailures)."""

    def request_seed(self, node: Node, version: int) -> int:
        from flexmarl_hpc.learn.sampling import sample_seed  # torch: not at import (tests/unit/test_imports.py)
        return sample_seed(self.cfg.run.seed, node.agent, version, node.sample_id)

    def take_pending(self, agent: str, sent: set[int]) -> None:
        """Drop the nodes sent to replicas (`id()`s) from `agent`'s pending queue, in place."""
        q = self.pending[agent]
        keep = [n for n in q if id(n) not in sent]
        q.clear()
        q.extend(keep)

    def est_tokens(self, node: Node) -> float:
        """Backlog estimate of one request: prompt + mean response length so far."""
        return len(node.prompt) + self.resp_len_mean[node.agent]

    def take_ready(self, agent: str, step: int, k: int) -> list[Node]:
        """Mark up to k READY samples of (agent, step) CONSUMED and return them."""
        q = self.ready[agent][step]
        take, self.ready[agent][step] = q[:k], q[k:]
        for n in take:
            n.status, n.trainer_step = CONSUMED, step
        return take

    def ready_count(self, agent: str, step: int) -> int:
        return len(self.ready[agent].get(step, ()))


class Tree(NodeQueues):
    """Trees of all live steps and per-agent queues (pending, ready)."""

    def __init__(self, cfg: Config, task: Task):
        self.cfg, self.task = cfg, task
        self.turns = cfg.workflow.turns
        self.agents = cfg.agent_names
        self.nodes: dict[tuple[str, str], Node] = {}       # (agent, sample_id) -> node
        self.pending: dict[str, deque[Node]] = {agent: deque() for agent in self.agents}
        self.ready: dict[str, dict[int, list[Node]]] = {agent: defaultdict(list) for agent in self.agents}
        self.turn_left: dict[tuple[int, int], int] = {}    # (step, turn) -> not yet generated
        self.steps_admitted: set[int] = set()
        self.batch_size = {agent: global_batch(cfg, agent) for agent in self.agents}
        # leaves below one node of each turn
        self.leaves_below = [math.prod(t.samples for t in self.turns[i + 1:]) for i in range(len(self.turns))]
        self.resp_len_mean = {agent: float(np.mean([t.max_new_tokens for t in self.turns if t.agent == agent]))
                              for agent in self.agents}
        # over-provisioning (see the module docstring)
        self.n_in, self.extra = cfg.workflow.inputs_per_step, cfg.pipeline.overprovision
        self.leaves_per_input = math.prod(t.samples for t in self.turns)
        self.leaves_left: dict[int, int] = {}                  # input -> leaves not generated
        self.held: dict[int, list[Node]] = defaultdict(list)   # input -> READY, not in a batch
        self.joined: dict[int, list[int]] = defaultdict(list)  # step -> inputs in its batch
        self.dropped: set[int] = set()                         # inputs left out
        self.dropping: list[Node] = []                         # generated, now DROPPED
        # step -> inputs whose whole tree a salvage lost in a step some agent's checkpoint
        # already holds: no version can sample them again, so the step trains without them
        self.lost_inputs: dict[int, set[int]] = {}

    # -- creating work -------------------------------------------------------------------
    def admit_step(self, step: int) -> Changes:
        """Create the roots of `step` (inputs drawn from (seed, step)) as pending turn-0 nodes
        (no status changes: EpisodeTree's admission can have some)."""
        if step in self.steps_admitted:
            return Changes()
        self.steps_admitted.add(step)
        n_in = self.n_in + self.extra
        inputs = self.task.sample_inputs(np.random.default_rng([self.cfg.run.seed, step]), n_in)
        for t, turn in enumerate(self.turns):
            self.turn_left[(step, t)] = n_in * math.prod(x.samples for x in self.turns[:t + 1])
        for input_id, x in zip(self.input_ids(step), inputs):
            self.leaves_left[input_id] = self.leaves_per_input
            self._spawn(None, step, input_id, x)
        return Changes()

    def input_ids(self, step: int) -> range:
        """The ids of a step's inputs (over-provisioned ones included)."""
        n = self.n_in + self.extra
        return range(step * n, (step + 1) * n)

    def _spawn(self, parent: Node | None, step: int, input_id: int, root_input) -> None:
        t = 0 if parent is None else parent.turn + 1
        turn = self.turns[t]
        group: list[Node] = []
        for b in range(turn.samples):
            traj = b if parent is None else parent.traj * turn.samples + b
            node = Node(turn.agent, t, step, input_id, traj, parent, group, root_input)
            group.append(node)
            key = (node.agent, node.sample_id)
            existing = self.nodes.get(key)
            if existing is not None:          # restored on resume: keep it, re-link
                existing.parent, existing.group, existing.root_input = parent, group, root_input
                group[-1] = existing
                continue
            self.nodes[key] = node
            node.prompt = self.task.prompt(t, node.path())
            self.pending[node.agent].append(node)
        if parent is not None:
            parent.children = group

    def request(self, node: Node, version: int) -> tuple:
        """(sample_id, prompt, seed, max_new_tokens, turn): a replica's GenRequest."""
        budget = self.task.response_budget(node.turn, node.sample_id, self.turns[node.turn].max_new_tokens)
        return node.sample_id, node.prompt, self.request_seed(node, version), budget, node.turn

    # -- results -------------------------------------------------------------------------
    def record_generation(self, batch: list[tuple[Node, list[int], list[float]]], version: int,
                          replica: int) -> Changes:
        """Generated samples: set their answers, advance their trees."""
        ch = Changes()
        late = [node for node, _, _ in batch if node.status == DROPPED]   # dropped on the replica
        for node, toks, lps in batch:
            node.response, node.logprobs = list(toks), list(lps)
            node.version, node.replica, node.status = version, replica, GENERATED
            ch.generated.append(node)
            self.turn_left[(node.step, node.turn)] -= 1
            mean = self.resp_len_mean[node.agent]
            self.resp_len_mean[node.agent] = 0.95 * mean + 0.05 * len(toks)
        self._mark_dropped(late)
        for node, _, _ in batch:
            if node.status == DROPPED:
                continue
            if node.turn == len(self.turns) - 1:
                ch.ready += self._leaf_done(node)
            else:
                self._spawn(node, node.step, node.input_id, node.root_input)
        ch.dropped, self.dropping = self.dropping, []
        return ch

    def _leaf_done(self, leaf: Node) -> list[Node]:
        """Propagate a finished leaf's rewards up its path; returns nodes whose group became ready."""
        path = leaf.path()
        rewards = self.task.reward(Path(path.input, path.responses + (tuple(leaf.response),)))
        ready: list[Node] = []
        node = leaf
        while node is not None:
            node.leaf_sum += rewards[node.agent]
            node.leaf_n += 1
            if node.leaf_n == self.leaves_below[node.turn]:
                node.reward = node.leaf_sum / node.leaf_n
                ready += self._group_ready(node.group)
            node = node.parent
        if self.extra:
            self.leaves_left[leaf.input_id] -= 1
            if self.leaves_left[leaf.input_id] == 0:
                self._input_done(leaf.step, leaf.input_id)
        return ready

    def _input_done(self, step: int, input_id: int) -> None:
        """Over-provisioning: a whole tree is generated. It joins the step's batch; with the
        batch full, the step's other inputs are dropped."""
        batch = self.joined[step]
        batch.append(input_id)
        for n in self.held.pop(input_id, []):
            self.ready[n.agent][n.step].append(n)
        if len(batch) < self.n_in:
            return
        losers = set(self.input_ids(step)) - set(batch) - self.dropped
        self.dropped |= losers
        self._mark_dropped([n for n in self.nodes.values() if n.input_id in losers])
        self._unqueue(losers)
        for i in losers:
            self.held.pop(i, None)

    def _unqueue(self, inputs: set[int]) -> None:
        """Take the pending nodes of these inputs out of the queues (never dispatched)."""
        for q in self.pending.values():
            keep = [n for n in q if n.input_id not in inputs]
            q.clear()
            q.extend(keep)

    def _mark_dropped(self, nodes: list[Node]) -> None:
        """Pending nodes and nodes on a replica have no row yet: a replica's answer for one
        is recorded as generated, then dropped (record_generation)."""
        for n in nodes:
            if n.status != DROPPED:
                n.status = DROPPED
                if n.response is not None:
                    self.dropping.append(n)

    def _group_ready(self, group: list[Node]) -> list[Node]:
        if any(n.reward is None for n in group) or group[0].status != GENERATED:
            return []
        from flexmarl_hpc.learn.grpo import group_advantages  # torch: not at import (tests/unit/test_imports.py)
        adv = group_advantages(np.array([n.reward for n in group]))
        for n, advantage in zip(group, adv):
            n.advantage, n.status = float(advantage), READY
        if self.extra and group[0].input_id not in self.joined[group[0].step]:
            self.held[group[0].input_id].extend(group)     # trainable once its input joins
        else:
            self.ready[group[0].agent][group[0].step].extend(group)
        return group

    # -- training ------------------------------------------------------------------------
    def batch_of(self, agent: str, step: int) -> int | None:
        """Samples of `agent` in `step`: fixed by the turns, less the trees of lost inputs
        (each input's tree has the same shape)."""
        lost = len(self.lost_inputs.get(step, ()))
        return self.batch_size[agent] * (self.n_in - lost) // self.n_in

    def loss_scale(self, agent: str, step: int) -> float:
        """Each sample's loss weight: 1 / the agent's batch of the step (a mean over samples)."""
        return 1.0 / max(1, self.batch_of(agent, step))

    def poll(self) -> Changes:
        """Nothing runs between replies in a fixed-turn workflow."""
        return Changes()

    def waiting(self) -> bool:
        return False

    def close(self) -> None:
        pass

    # -- resume -------------------------------------------------------------------------
    def restore(self, nodes: list[Node], first_step: int, versions: dict[str, int]) -> tuple[list[Node], Changes]:
        """Rebuild the trees of steps >= first_step from journalled nodes (unlinked, with
        the status their rows have). A node consumed by an optimizer step the trainers do
        not have (trainer_step >= the agent's restored version) goes back to GENERATED and
        then READY again; generated ones are reused as they are, so nothing is sampled or
        trained twice. Returns (the requeued nodes, the changes to journal after them);
        `Changes.ready` leaves out nodes already READY in the journal."""
        check_linked(nodes, self.turns)
        requeue, was_ready = [], set()
        for n in nodes:
            if n.status == CONSUMED and n.trainer_step >= versions[n.agent]:
                n.status, n.trainer_step = GENERATED, -1
                requeue.append(n)
            elif n.status == READY:
                n.status = GENERATED
                was_ready.add(id(n))
            elif n.status == DROPPED:
                self.dropped.add(n.input_id)
            self.nodes[(n.agent, n.sample_id)] = n
        last = max((n.step for n in nodes), default=first_step - 1)
        self._find_lost(nodes, first_step, max(versions.values(), default=0))
        last = max([last, *self.lost_inputs])
        for step in range(first_step, last + 1):
            self.admit_step(step)
            self._forget_lost(step)
        ready: list[Node] = []
        by_turn = defaultdict(list)
        for n in self.nodes.values():
            if n.step >= first_step and n.response is not None:
                by_turn[n.turn].append(n)
        for t in range(len(self.turns)):        # replay the trees turn by turn
            for node in by_turn[t]:
                if node.input_id in self.dropped:
                    self._mark_dropped([node])
                    continue
                self.turn_left[(node.step, t)] -= 1
                if t == len(self.turns) - 1:
                    ready += self._leaf_done(node)
                else:
                    self._spawn(node, node.step, node.input_id, node.root_input)
        self._unqueue(self.dropped)             # roots of dropped inputs, spawned again above
        # consumed-and-committed nodes went through _group_ready without changing status
        ch = Changes(dropped=[n for n in self.dropping if n.status == DROPPED],
                     ready=[n for n in ready if id(n) not in was_ready])
        self.dropping = []
        return requeue, ch

    def _find_lost(self, nodes: list[Node], first_step: int, ahead: int) -> None:
        """Inputs of steps before `ahead` (the furthest restored version) with no row at all:
        an agent trained those steps, so every input of them had its tree generated; one
        without rows was lost (salvage drops whole trees). Sampling it again would take
        weights of its step that agent no longer has, so the step goes on without it (with
        over-provisioning: dropped, as an input left out is). Later steps' missing inputs
        are sampled again, as after any kill."""
        have = {n.input_id for n in nodes}
        for step in range(first_step, ahead):
            gone = set(self.input_ids(step)) - have
            if gone and self.extra:
                self.dropped |= gone
            elif gone:
                self.lost_inputs[step] = gone

    def _forget_lost(self, step: int) -> None:
        """Take a step's lost inputs out again after admit_step spawned their roots: out of
        the queues, the nodes and the turns' counts (sync mode's barrier waits on those)."""
        gone = self.lost_inputs.get(step, set())
        if not gone:
            return
        self._unqueue(gone)
        for key in [k for k, n in self.nodes.items() if n.input_id in gone]:
            del self.nodes[key]
        for t in range(len(self.turns)):
            self.turn_left[(step, t)] -= len(gone) * math.prod(x.samples for x in self.turns[:t + 1])
        for i in gone:
            self.leaves_left.pop(i, None)

    def forget_step(self, step: int) -> None:
        """Drop finished trees of a fully trained step from memory (the journal keeps them)."""
        for key in [k for k, n in self.nodes.items() if n.step == step]:
            del self.nodes[key]
        for agent in self.agents:
            self.ready[agent].pop(step, None)
        for i in self.input_ids(step):
            self.leaves_left.pop(i, None)
            self.held.pop(i, None)
            self.dropped.discard(i)
        self.joined.pop(step, None)
        self.lost_inputs.pop(step, None)


def check_linked(nodes: list[Node], turns) -> None:
    """Every journalled sample of a later turn has its parent's row (turn t-1, trajectory
    traj // samples of turn t); one without (a store salvaged by a release that kept
    orphans) cannot be replayed: refused in one line, before the resume writes anything."""
    have = {(n.agent, n.sample_id) for n in nodes}
    for n in nodes:
        if n.turn > 0:
            parent = (turns[n.turn - 1].agent, f"{n.input_id}_{n.turn - 1}_{n.traj // turns[n.turn].samples}")
            if parent not in have:
                raise StoreInconsistent(f"{n.agent} sample {n.sample_id} (step {n.step}) has no parent row "
                                        f"({parent[0]} {parent[1]}) in the store; salvage it "
                                        "(python -m flexmarl_hpc.analyze salvage)")


def global_batch(cfg: Config, agent: str) -> int:
    """Samples of `agent` per step: inputs x branching down to each of its turns."""
    total, width = 0, cfg.workflow.inputs_per_step
    for t in cfg.workflow.turns:
        width *= t.samples
        if t.agent == agent:
            total += width
    return total
