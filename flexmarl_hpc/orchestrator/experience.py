"""The experience store: the workflow trees (tree.py) written through to their HDF5 journal.

Lives on the orchestrator. `Journal` turns the trees' status changes into /samples rows,
/tokens pool entries, /events rows and in-place status patches of a `StoreFile`;
`Experience` is a `Tree` whose every change goes through the journal, and is flushed
(committed) before it is acted on: generated rows after each generation batch (the
orchestrator flushes), CONSUMED before a micro-batch reaches the trainer (take_ready).

On resume (`reload`), rows of uncommitted steps are reloaded instead of regenerated, and
consumed-but-uncommitted rows go back to READY, so no sample is lost or trained twice.
"""
from __future__ import annotations

import math
from itertools import chain, compress, repeat
from operator import attrgetter

import numpy as np

from flexmarl_hpc.config.schema import Config
from flexmarl_hpc.store.tables import StoreFile
from flexmarl_hpc.store.schema import CONSUMED, DROPPED, GENERATED, READY
from flexmarl_hpc.orchestrator.episodes import EpisodeTree, ReplayMismatch
from flexmarl_hpc.orchestrator.tree import Changes, Node, Tree, global_batch  # noqa: F401  (re-exported)
from flexmarl_hpc.workflows.base import Task


def _spans(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The positions [start_i, start_i + len_i) of every i, concatenated."""
    return np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))


def _by_agent(nodes: list[Node]) -> list[tuple[str, list[Node]]]:
    """The nodes grouped by agent (in order of first appearance), each group in the nodes'
    order: a few passes in C, no Python frame per node (a batch is most often of one agent;
    a leaf's READY also readies its ancestors, of the other agents)."""
    if not nodes:
        return []
    names = list(map(attrgetter("agent"), nodes))
    if names.count(names[0]) == len(names):
        return [(names[0], nodes)]
    return [(a, list(compress(nodes, map(a.__eq__, names)))) for a in dict.fromkeys(names)]


def _parent_ids(nodes: list[Node]) -> list[str]:
    """Each node's parent_id column: its parent_call (episode workflows), else its parent's
    sample_id ("" for a root). A batch of one fixed turn is all roots or all children with
    no parent_call: then C passes, no Python frame per node."""
    if not any(map(attrgetter("parent_call"), nodes)):
        parents = list(map(attrgetter("parent"), nodes))
        if all(parents):
            return list(map(attrgetter("sample_id"), parents))
        if not any(parents):
            return [""] * len(nodes)
    return [n.parent_call or (n.parent.sample_id if n.parent else "") for n in nodes]


class NotReady(RuntimeError):
    """A sample about to be handed to a trainer that the journal does not have READY with a
    finite reward and advantage: training it would leave a consumed row without its reward."""


class Journal:
    """Records nodes and their status changes in the store (buffered until its flush)."""

    def __init__(self, store: StoreFile):
        self.store = store
        self.agent_index = {agent: i for i, agent in enumerate(store.agents)}

    def changes(self, ch: Changes, now: float, version: int | None = None,
                replica: int | None = None) -> None:
        """Record what a generation batch (or a poll) changed: its rows, then READY, then
        DROPPED (a node made ready can be dropped by the same batch: this order).
        `version`/`replica`: those of every generated node (one batch), if known."""
        self.generated(ch.generated, now, version, replica)
        self.status(ch.ready, READY, now)
        self.status(ch.dropped, DROPPED, now)

    def generated(self, nodes: list[Node], now: float, version: int | None = None,
                  replica: int | None = None) -> None:
        """Append rows (+ tokens) for newly generated nodes and set their `row`."""
        for agent, ns in _by_agent(nodes):
            self._append(agent, ns, now, version, replica)

    def _append(self, agent: str, nodes: list[Node], now: float, version: int | None,
                replica: int | None) -> None:
        # the pool rows are one array: prompt, then response, logprob NaN on prompts (and
        # past a response's logprobs, if it has fewer). Each column is one C-level pass over
        # the nodes (map / chain.from_iterable into np.fromiter, no Python frame per
        # sample), scattered to its positions by index arithmetic
        tab, pool = self.store.samples[agent], self.store.tokens[agent]
        k = len(nodes)
        prompts, responses = list(map(attrgetter("prompt"), nodes)), list(map(attrgetter("response"), nodes))
        logprobs = list(map(attrgetter("logprobs"), nodes))
        plen, rlen, llen = (np.fromiter(map(len, xs), np.int64, k) for xs in (prompts, responses, logprobs))
        if (llen > rlen).any():               # they would land on the next sample's tokens
            bad = nodes[int(np.argmax(llen > rlen))]
            raise ValueError(f"{agent} sample {bad.sample_id}: {len(bad.logprobs)} log-probs for "
                             f"{len(bad.response)} response tokens")
        ends = np.cumsum(plen + rlen)
        rstarts = ends - rlen
        toks = np.empty(int(ends[-1]), pool.dtype)
        # each sample's prompt then its response, back to back: the pool's order, one pass
        toks["token"] = np.fromiter(chain.from_iterable(chain.from_iterable(zip(prompts, responses))),
                                    np.int32, len(toks))
        toks["logprob"] = np.nan
        toks["logprob"][_spans(rstarts, llen)] = np.fromiter(chain.from_iterable(logprobs), np.float32,
                                                             int(llen.sum()))
        off = pool.append(toks)
        rows = np.empty(k, tab.dtype)
        rows["sample_id"] = list(map(attrgetter("sample_id"), nodes))        # ASCII: numpy encodes
        rows["parent_id"] = _parent_ids(nodes)
        # a batch's version and replica are one value each: no pass over the nodes for them
        for name, attr, value in (("input_id", "input_id", None), ("turn", "turn", None), ("traj", "traj", None),
                                  ("step", "step", None), ("policy_version", "version", version),
                                  ("replica", "replica", replica)):
            rows[name] = np.fromiter(map(attrgetter(attr), nodes), np.int64, k) if value is None else value
        rows["status"] = GENERATED
        rows["trainer_step"] = -1
        for name in ("reward", "advantage", "t_ready", "t_consumed"):
            rows[name] = np.nan
        rows["t_generated"] = now
        rows["token_offset"] = off + ends - plen - rlen
        rows["prompt_len"], rows["response_len"] = plen, rlen
        rows["retokenized"] = np.fromiter(map(attrgetter("retokenized"), nodes), np.int8, k)
        rows["prefill_len"] = np.fromiter(map(attrgetter("prefill_len"), nodes), np.int32, k)
        first = tab.append(rows)
        any(map(setattr, nodes, repeat("row"), range(first, first + k)))   # n.row = i, in C
        any(map(setattr, nodes, repeat("journalled"), repeat(GENERATED)))
        self._events(agent, np.arange(first, first + k), None, GENERATED, now, -1)

    def status(self, nodes: list[Node], status: int, now: float, trainer_step: int = -1) -> None:
        """Record a status change of journalled nodes: one /events append and one queued
        patch of their rows per agent (READY also records reward and advantage)."""
        for agent, ns in _by_agent(nodes):
            rows = np.fromiter(map(attrgetter("row"), ns), np.int64, len(ns))
            fields: dict = {"status": status}
            if status == READY:
                fields.update(reward=np.fromiter(map(attrgetter("reward"), ns), np.float32, len(ns)),
                              advantage=np.fromiter(map(attrgetter("advantage"), ns), np.float32,
                                                    len(ns)),
                              t_ready=now)
            elif status == CONSUMED:
                fields.update(trainer_step=trainer_step, t_consumed=now)
            else:
                fields.update(trainer_step=-1, t_consumed=np.nan)
            self.store.samples[agent].patch(rows, fields)
            any(map(setattr, ns, repeat("journalled"), repeat(status)))
            self._events(agent, rows, fields, status, now, trainer_step)

    def _events(self, agent: str, rows: np.ndarray, fields, status: int, now: float,
                tstep: int) -> None:
        ev = np.empty(len(rows), self.store.events.dtype)
        ev["agent"] = self.agent_index[agent]
        ev["row"] = rows
        ev["status"], ev["t"], ev["trainer_step"] = status, now, tstep
        if status == READY:
            ev["reward"], ev["advantage"] = fields["reward"], fields["advantage"]
        else:
            ev["reward"] = ev["advantage"] = np.nan
        self.store.events.append(ev)

    def load(self, first_step: int) -> list[Node]:
        """Unlinked nodes for every row of steps >= first_step, with the status (and
        trainer_step) the file has. One read of the rows and one of their token range."""
        out = []
        for agent in self.store.agents:
            tab, pool = self.store.samples[agent], self.store.tokens[agent]
            rows = tab.read()
            idx = np.nonzero(rows["step"] >= first_step)[0]
            if not len(idx):
                continue
            r = rows[idx]
            lo = int(r["token_offset"].min())
            hi = int((r["token_offset"] + r["prompt_len"] + r["response_len"]).max())
            toks = pool.read(lo, hi)
            tok, lps = toks["token"].tolist(), toks["logprob"].tolist()
            for i, x in zip(idx.tolist(), r.tolist()):
                row = dict(zip(r.dtype.names, x))
                o, pl, rl = row["token_offset"] - lo, row["prompt_len"], row["response_len"]
                out.append(Node(agent, row["turn"], row["step"], row["input_id"], row["traj"], None, [],
                                None, prompt=tok[o:o + pl], response=tok[o + pl:o + pl + rl],
                                logprobs=lps[o + pl:o + pl + rl], version=row["policy_version"],
                                replica=row["replica"], status=row["status"], row=i,
                                trainer_step=row["trainer_step"], journalled=row["status"],
                                retokenized=row["retokenized"], prefill_len=row["prefill_len"]))
        return out


class Journaled:
    """Write-through of a Tree or an EpisodeTree (the class it is mixed into) to the store."""

    def _journal_to(self, store: StoreFile) -> None:
        self.store = store
        self.journal = Journal(store)

    def record_generation(self, batch, version: int, replica: int) -> Changes:
        """Record generated samples and what they made ready or dropped (the caller
        flushes once per batch, before acting on it)."""
        ch = super().record_generation(batch, version, replica)
        self.journal.changes(ch, self.store.now(), version, replica)
        return ch

    def admit_step(self, step: int) -> Changes:
        """Admit a step; what that changed (episodes of earlier steps that ended on a tool
        result while the new ones started) is journalled like a poll's."""
        ch = super().admit_step(step)
        self.journal.changes(ch, self.store.now())
        return ch

    def poll(self) -> Changes:
        """What went on between replies (episodes finishing on a tool result), journalled."""
        ch = super().poll()
        self.journal.changes(ch, self.store.now())
        return ch

    def take_ready(self, agent: str, step: int, k: int) -> list[Node]:
        """Mark up to k READY samples of (agent, step) CONSUMED, durably, and return them;
        NotReady (nothing consumed) if one is not READY in the journal with its reward."""
        refuse_unready(self.ready[agent].get(step, [])[:k])
        take = super().take_ready(agent, step, k)
        if take:
            self.journal.status(take, CONSUMED, self.store.now(), step)
            self.store.flush(full=False)         # durable before the trainer sees them
        return take

    def reload(self, first_step: int, versions: dict[str, int]) -> int:
        """Bring back every row of steps >= first_step from the file and rebuild the trees
        (restore): consumed rows the restored trainers do not contain go back to
        GENERATED, then READY (recorded in /events). Returns the last step found
        (first_step - 1 if none)."""
        nodes = self.journal.load(first_step)
        try:
            requeue, ch = self.restore(nodes, first_step, versions)
        except ReplayMismatch as e:     # refused after the re-open's repairs: the file as it was
            self.store.revert()
            raise ReplayMismatch(f"{e}; {self.store.path} is left as it was before this resume") from None
        now = self.store.now()
        self.journal.status(requeue, GENERATED, now)
        self.journal.status(ch.ready, READY, now)
        self.journal.status(ch.dropped, DROPPED, now)
        self.store.flush()
        return max([n.step for n in nodes] + list(self.lost_inputs), default=first_step - 1)


def refuse_unready(nodes: list[Node]) -> None:
    """The last gate before a trainer: every sample READY, in memory and in the journal, with
    a finite reward and advantage; else NotReady naming the first that is not (issue 35: a
    READY change that missed the journal was trained, its row consumed with reward NaN)."""
    for n in nodes:
        r = math.nan if n.reward is None else n.reward
        if n.status != READY or n.journalled != READY or not math.isfinite(r + n.advantage):
            raise NotReady(f"{n.agent} sample {n.sample_id}: not ready in the journal (status {n.status}, "
                           f"journalled {n.journalled}, reward {n.reward}, advantage {n.advantage}): "
                           "its micro-batch is refused, not trained")


class Experience(Journaled, Tree):
    """The trees of all live steps (fixed-turn workflows), each change written through."""

    def __init__(self, cfg: Config, task: Task, store: StoreFile):
        Tree.__init__(self, cfg, task)
        self._journal_to(store)


class EpisodeExperience(Journaled, EpisodeTree):
    """The episodes of all live steps (episode workflows), each change written through:
    their calls as /samples rows, their tool calls as /tools rows, each finished episode as
    an /episodes row (once: a replayed episode already recorded is not recorded again)."""

    def __init__(self, cfg: Config, task, store: StoreFile, tools=None):
        """`tools`: the pool that runs tool calls (ranks/tool_ranks.py's RemotePool with tool
        ranks); None: a tools.pool.WorkerPool on this node."""
        pool = tools
        if pool is None:
            from flexmarl_hpc.tools.pool import WorkerPool
            from flexmarl_hpc.tools.registry import Tools
            pool = WorkerPool(Tools.from_config(cfg.tools), cfg.tools)
        EpisodeTree.__init__(self, cfg, task, task.runner(cfg, tools=pool, record_tool=self._tool_done))
        self._journal_to(store)

    def _tool_done(self, ctx, tool: str, outcome: str, latency_s: float) -> None:
        """A tool call ended: its /tools row names the call whose reply asked for it."""
        last = ctx.last_done
        if (ctx.example_id, ctx.episode) in self.recorded:
            return                  # a replayed episode the file has whole: its tools are there
        self.store.record_tool(self.store.now(), None if last is None else last.agent, ctx.example_id,
                               ctx.episode, -1 if last is None else last.index, tool, outcome, latency_s)

    def _episode_done(self, f) -> list[Node]:
        ready = super()._episode_done(f)
        ctx = f.ctx
        if (ctx.example_id, ctx.episode) not in self.recorded:
            self.recorded.add((ctx.example_id, ctx.episode))
            if f.failure is not None:            # why, for analyze and status (issue 40)
                e = f.failure
                self.store.record_failure(self.store.now(), ctx.step, ctx.example_id, ctx.episode,
                                          e.kind, e.message, e.traceback)
            rewards = {a: float(np.mean(r)) if isinstance(r, list) else r for a, r in f.rewards.items()
                       if not isinstance(r, list) or r}
            self.store.record_episode(self.store.now(), ctx.step, ctx.example_id, ctx.episode,
                                      dict(ctx.calls), rewards)
        return ready

    def reload(self, first_step: int, versions: dict[str, int]) -> int:
        rows = self.store.episodes.read()
        self.recorded = {(int(i), int(t)) for i, t in zip(rows["input_id"], rows["traj"])}
        return super().reload(first_step, versions)

    def forget_step(self, step: int) -> None:
        super().forget_step(step)
        n = self.n_in
        self.recorded = {k for k in self.recorded if not step * n <= k[0] < (step + 1) * n}


def experience_for(cfg: Config, task, store: StoreFile, tools=None) -> Experience | EpisodeExperience:
    """The experience of `cfg`'s workflow: episodes (workflow.episode, their tool calls on
    `tools`, default a local pool) or fixed turns."""
    if cfg.workflow.episode:
        return EpisodeExperience(cfg, task, store, tools)
    return Experience(cfg, task, store)
