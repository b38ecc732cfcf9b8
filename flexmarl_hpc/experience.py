"""The experience store: workflow trees, rewards, advantages, statuses, write-through.

Lives on the orchestrator. Each root input of step s grows a tree: turn t's agent answers
every path of turn t-1 `samples[t]` times. A node is one sample with
sample_id = {input_id}_{turn}_{trajectory_id}. Its life:

    pending  -> (dispatched to a replica) -> GENERATED  (row appended to HDF5)
             -> READY     once its reward (mean of the leaves below it) and those of its
                          siblings are known, so the group advantage can be computed
             -> CONSUMED  when handed to its agent's trainer (recorded and flushed before
                          the micro-batch is sent)
             -> DROPPED   (pipeline.overprovision only) its input was not among the first
                          inputs_per_step of its step to finish; never trained

Over-provisioning: a step admits inputs_per_step + overprovision inputs; an input joins the
step's batch when its whole tree is generated (its READY samples wait until then), and once
inputs_per_step have joined, the step's other inputs are dropped, whatever state they are
in (pending, on a replica, generated). Which inputs win depends on timing, so such a run is
not reproducible sample for sample; every generated sample is still trained once or dropped.

Every change is written through (`StoreFile`) before it is acted on. On resume, rows of
uncommitted steps are reloaded instead of regenerated, and consumed-but-uncommitted rows
go back to READY, so no sample is lost or trained twice.
"""
from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from .config import Config
from .grpo import group_advantages
from .sampling import sample_seed
from .store import CONSUMED, DROPPED, GENERATED, READY, StoreFile
from .workflows.base import Path, Task


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
    row: int = -1
    trainer_step: int = -1

    @property
    def sample_id(self) -> str:
        return f"{self.input_id}_{self.turn}_{self.traj}"

    def path(self) -> Path:
        resp, n = [], self.parent
        while n is not None:
            resp.append(tuple(n.response))
            n = n.parent
        return Path(self.root_input, tuple(reversed(resp)))


class Experience:
    """Trees of all live steps, per-agent queues, and the HDF5 write-through."""

    def __init__(self, cfg: Config, task: Task, store: StoreFile):
        self.cfg, self.task, self.store = cfg, task, store
        self.turns = cfg.workflow.turns
        self.agents = cfg.agent_names
        self.nodes: dict[tuple[str, str], Node] = {}       # (agent, sample_id) -> node
        self.pending: dict[str, deque[Node]] = {a: deque() for a in self.agents}
        self.ready: dict[str, dict[int, list[Node]]] = {a: defaultdict(list) for a in self.agents}
        self.turn_left: dict[tuple[int, int], int] = {}    # (step, turn) -> not yet generated
        self.steps_admitted: set[int] = set()
        self.batch_size = {a: global_batch(cfg, a) for a in self.agents}
        # leaves below one node of each turn
        self.leaves_below = [math.prod(t.samples for t in self.turns[i + 1:]) for i in range(len(self.turns))]
        self.resp_len_mean = {a: float(np.mean([t.max_new_tokens for t in self.turns if t.agent == a]))
                              for a in self.agents}
        # over-provisioning (see the module docstring)
        self.n_in, self.extra = cfg.workflow.inputs_per_step, cfg.pipeline.overprovision
        self.leaves_per_input = math.prod(t.samples for t in self.turns)
        self.leaves_left: dict[int, int] = {}                  # input -> leaves not generated
        self.held: dict[int, list[Node]] = defaultdict(list)   # input -> READY, not in a batch
        self.joined: dict[int, list[int]] = defaultdict(list)  # step -> inputs in its batch
        self.dropped: set[int] = set()                         # inputs left out
        self.dropping: list[Node] = []                         # to write as DROPPED

    # -- creating work -------------------------------------------------------------------
    def admit_step(self, step: int) -> None:
        """Create the roots of `step` (inputs drawn from (seed, step)) as pending turn-0 nodes."""
        if step in self.steps_admitted:
            return
        self.steps_admitted.add(step)
        n_in = self.n_in + self.extra
        inputs = self.task.sample_inputs(np.random.default_rng([self.cfg.run.seed, step]), n_in)
        for t, turn in enumerate(self.turns):
            self.turn_left[(step, t)] = n_in * math.prod(x.samples for x in self.turns[:t + 1])
        for input_id, x in zip(self.input_ids(step), inputs):
            self.leaves_left[input_id] = self.leaves_per_input
            self._spawn(None, step, input_id, x)

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
            if existing is not None:          # reloaded on resume: keep it, re-link
                existing.parent, existing.group, existing.root_input = parent, group, root_input
                group[-1] = existing
                continue
            self.nodes[key] = node
            node.prompt = self.task.prompt(t, node.path())
            self.pending[node.agent].append(node)
        if parent is not None:
            parent.children = group

    def request_seed(self, node: Node, version: int) -> int:
        return sample_seed(self.cfg.run.seed, node.agent, version, node.sample_id)

    def est_tokens(self, node: Node) -> float:
        """Backlog estimate of one request: prompt + mean response length so far."""
        return len(node.prompt) + self.resp_len_mean[node.agent]

    # -- results -------------------------------------------------------------------------
    def record_generation(self, batch: list[tuple[Node, list[int], list[float]]], version: int,
                          replica: int) -> None:
        """Append generated samples (one HDF5 write per column), then advance their trees."""
        now = self.store.now()
        by_agent: dict[str, list] = defaultdict(list)
        late = [node for node, _, _ in batch if node.status == DROPPED]   # dropped on the replica
        for node, toks, lps in batch:
            node.response, node.logprobs = list(toks), list(lps)
            node.version, node.replica, node.status = version, replica, GENERATED
            by_agent[node.agent].append(node)
            self.turn_left[(node.step, node.turn)] -= 1
            a = self.resp_len_mean[node.agent]
            self.resp_len_mean[node.agent] = 0.95 * a + 0.05 * len(toks)
        for agent, nodes in by_agent.items():
            self._append_rows(agent, nodes, now)
        self._mark_dropped(late)
        newly_ready: list[Node] = []
        for node, _, _ in batch:
            if node.status == DROPPED:
                continue
            if node.turn == len(self.turns) - 1:
                newly_ready += self._leaf_done(node)
            else:
                self._spawn(node, node.step, node.input_id, node.root_input)
        self._write_ready(newly_ready)
        self._write_dropped()

    def _append_rows(self, agent: str, nodes: list[Node], now: float) -> None:
        tab = self.store.samples[agent]
        flat_tok = np.concatenate([np.asarray(n.prompt + n.response, np.int32) for n in nodes])
        flat_lp = np.concatenate([np.concatenate([np.full(len(n.prompt), np.nan, np.float32),
                                                  np.asarray(n.logprobs, np.float32)]) for n in nodes])
        off = tab.extend_pool("tokens", flat_tok)
        tab.extend_pool("logprobs", flat_lp)
        lens = np.array([len(n.prompt) + len(n.response) for n in nodes])
        offsets = off + np.concatenate([[0], np.cumsum(lens)[:-1]])
        k = len(nodes)
        first = tab.append({
            "sample_id": [n.sample_id.encode() for n in nodes],
            "parent_id": [(n.parent.sample_id if n.parent else "").encode() for n in nodes],
            "input_id": [n.input_id for n in nodes], "turn": [n.turn for n in nodes],
            "traj": [n.traj for n in nodes], "step": [n.step for n in nodes],
            "policy_version": [n.version for n in nodes], "replica": [n.replica for n in nodes],
            "status": [GENERATED] * k, "reward": [np.nan] * k, "advantage": [np.nan] * k,
            "trainer_step": [-1] * k, "t_generated": [now] * k, "t_ready": [np.nan] * k,
            "t_consumed": [np.nan] * k, "token_offset": offsets,
            "prompt_len": [len(n.prompt) for n in nodes],
            "response_len": [len(n.response) for n in nodes],
        })
        for i, n in enumerate(nodes):
            n.row = first + i
        self._events(agent, [n.row for n in nodes], GENERATED, now, -1)

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
        is written as generated, then dropped (record_generation)."""
        for n in nodes:
            if n.status != DROPPED:
                n.status = DROPPED
                if n.row >= 0:
                    self.dropping.append(n)

    def _write_dropped(self) -> None:
        nodes, self.dropping = self.dropping, []
        by_agent: dict[str, list[int]] = defaultdict(list)
        for n in nodes:
            by_agent[n.agent].append(n.row)
        now = self.store.now()
        for agent, rows in by_agent.items():
            self.store.samples[agent].update("status", rows, DROPPED)
            self._events(agent, rows, DROPPED, now, -1)

    def _group_ready(self, group: list[Node]) -> list[Node]:
        if any(n.reward is None for n in group) or group[0].status != GENERATED:
            return []
        adv = group_advantages(np.array([n.reward for n in group]))
        for n, a in zip(group, adv):
            n.advantage, n.status = float(a), READY
        if self.extra and group[0].input_id not in self.joined[group[0].step]:
            self.held[group[0].input_id].extend(group)     # trainable once its input joins
        else:
            self.ready[group[0].agent][group[0].step].extend(group)
        return group

    def _write_ready(self, nodes: list[Node]) -> None:
        """One HDF5 write per column and agent for all samples that just became ready."""
        now = self.store.now()
        by_agent: dict[str, list[Node]] = defaultdict(list)
        for n in nodes:
            by_agent[n.agent].append(n)
        for agent, ns in by_agent.items():
            tab = self.store.samples[agent]
            rows = [n.row for n in ns]
            tab.update("reward", rows, [n.reward for n in ns])
            tab.update("advantage", rows, [n.advantage for n in ns])
            tab.update("status", rows, READY)
            tab.update("t_ready", rows, now)
            self._events(agent, rows, READY, now, -1)

    # -- training ------------------------------------------------------------------------
    def take_ready(self, agent: str, step: int, k: int) -> list[Node]:
        """Mark up to k READY samples of (agent, step) CONSUMED (durably) and return them."""
        q = self.ready[agent][step]
        take, self.ready[agent][step] = q[:k], q[k:]
        if not take:
            return take
        tab, now = self.store.samples[agent], self.store.now()
        rows = [n.row for n in take]
        for n in take:
            n.status, n.trainer_step = CONSUMED, step
        tab.update("status", rows, CONSUMED)
        tab.update("trainer_step", rows, step)
        tab.update("t_consumed", rows, now)
        self._events(agent, rows, CONSUMED, now, step)
        self.store.flush()                       # durable before the trainer sees them
        return take

    def ready_count(self, agent: str, step: int) -> int:
        return len(self.ready[agent].get(step, ()))

    def _events(self, agent: str, rows: list[int], status: int, now: float, tstep: int) -> None:
        k = len(rows)
        self.store.events.append({"agent": [self.agents.index(agent)] * k, "row": rows,
                                  "status": [status] * k, "t": [now] * k, "trainer_step": [tstep] * k})

    # -- resume -------------------------------------------------------------------------
    def reload(self, first_step: int, versions: dict[str, int]) -> int:
        """Bring back every row of steps >= first_step from the file and rebuild the trees.

        Rows consumed by an optimizer step that was not checkpointed (trainer_step >= the
        agent's restored version) go back to READY (recorded in /events); generated rows
        are reused as they are, so nothing is sampled or trained twice. Returns the last
        step found (first_step - 1 if none)."""
        last = first_step - 1
        requeue: dict[str, list[int]] = defaultdict(list)
        was_ready: set[tuple[str, int]] = set()          # READY in the file already: no new event
        for agent in self.agents:
            tab = self.store.samples[agent]
            if tab.n == 0:
                continue
            col = {k: tab.ds[k][:] for k in ("step", "turn", "input_id", "traj", "policy_version",
                                             "replica", "status", "trainer_step", "token_offset",
                                             "prompt_len", "response_len")}
            rows = np.nonzero(col["step"] >= first_step)[0]
            for r in rows:
                off, pl, rl = (int(col[k][r]) for k in ("token_offset", "prompt_len", "response_len"))
                toks = tab.ds["tokens"][off:off + pl + rl].tolist()
                lps = tab.ds["logprobs"][off + pl:off + pl + rl].tolist()
                node = Node(agent, int(col["turn"][r]), int(col["step"][r]), int(col["input_id"][r]),
                            int(col["traj"][r]), None, [], None, prompt=toks[:pl], response=toks[pl:],
                            logprobs=lps, version=int(col["policy_version"][r]),
                            replica=int(col["replica"][r]), status=GENERATED, row=int(r))
                committed = col["status"][r] == CONSUMED and col["trainer_step"][r] < versions[agent]
                if committed:
                    node.status, node.trainer_step = CONSUMED, int(col["trainer_step"][r])
                elif col["status"][r] == CONSUMED:
                    requeue[agent].append(int(r))
                elif col["status"][r] == READY:
                    was_ready.add((agent, int(r)))
                elif col["status"][r] == DROPPED:
                    node.status = DROPPED
                    self.dropped.add(node.input_id)
                self.nodes[(agent, node.sample_id)] = node
                last = max(last, node.step)
        for agent, rows in requeue.items():     # undo consumption the checkpoint does not contain
            tab = self.store.samples[agent]
            tab.update("status", rows, GENERATED)
            tab.update("trainer_step", rows, -1)
            self._events(agent, rows, GENERATED, self.store.now(), -1)
        for step in range(first_step, last + 1):
            self.admit_step(step)
        ready: list[Node] = []
        for t in range(len(self.turns)):        # replay the trees turn by turn
            for node in [n for n in self.nodes.values() if n.turn == t and n.step >= first_step]:
                if node.response is None:
                    continue
                if node.input_id in self.dropped:
                    self._mark_dropped([node])
                    continue
                self.turn_left[(node.step, t)] -= 1
                if t == len(self.turns) - 1:
                    ready += self._leaf_done(node)
                else:
                    self._spawn(node, node.step, node.input_id, node.root_input)
        self._unqueue(self.dropped)             # roots of dropped inputs, spawned again above
        self._write_ready([n for n in ready if (n.agent, n.row) not in was_ready])
        self._write_dropped()
        self.store.flush()
        return last

    def forget_step(self, step: int) -> None:
        """Drop finished trees of a fully trained step from memory (the file keeps them)."""
        for key in [k for k, n in self.nodes.items() if n.step == step]:
            del self.nodes[key]
        for a in self.agents:
            self.ready[a].pop(step, None)
        for i in self.input_ids(step):
            self.leaves_left.pop(i, None)
            self.held.pop(i, None)
            self.dropped.discard(i)
        self.joined.pop(step, None)


def global_batch(cfg: Config, agent: str) -> int:
    """Samples of `agent` per step: inputs x branching down to each of its turns."""
    total, width = 0, cfg.workflow.inputs_per_step
    for t in cfg.workflow.turns:
        width *= t.samples
        if t.agent == agent:
            total += width
    return total
