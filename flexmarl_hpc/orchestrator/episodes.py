"""The live episodes of an episode workflow (workflows/episode.py): every chat call is a node.

The same interface as tree.Tree, so the orchestrator, the journal and the scheduler serve
both. Each step admits `inputs_per_step` examples of the dataset stream, each run as
`group_size` episodes. A call's node (sample_id = {example}_{call index}_{episode}) is

    pending -> GENERATED -> READY once every episode of its example has finished, or settled
    its agent (ctx.settle: the agent's reward known mid-episode) -> CONSUMED

(its GRPO group, learn.grpo.call_advantages, is then known). An agent's batch of a step is
known only once all of the step's episodes have finished or settled it (`batch_of` is None
before): the trainer gets full micro-batches as they become ready and
the step's last, partial one at the end. The loss of every call is scaled by
1 / (episodes per step), a constant known up front (a sum over an episode's calls, a mean
over episodes), so micro-batches can be trained before the batch size is known.

A failed episode (it raised, or returned no usable reward: workflows/episode.py) is counted
by kind (episode_failures.py, which also decides when the run must stop); its calls whose
reward it did not settle are DROPPED (`workflow.on_error: drop`, never trained, left out of
their GRPO groups and of the step's batch; a call still in flight is dropped when its reply
comes, one not yet sent is never generated) or get reward 0 (`zero`).

Resume replays: the episodes of unfinished steps run again from the start, and a call
whose node the journal holds gets its recorded response at once (no replica is asked), so
nothing is generated or trained twice. A replayed call whose prompt differs from the
recorded one means the episode function is not deterministic: the run stops and says so.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field


from flexmarl_hpc.config.schema import Config
from flexmarl_hpc.orchestrator.tree import Changes, Node, NodeQueues
from flexmarl_hpc.orchestrator.episode_failures import EpisodeFailures
from flexmarl_hpc.store.checksum import StoreInconsistent
from flexmarl_hpc.store.schema import CONSUMED, DROPPED, GENERATED, READY
from flexmarl_hpc.workflows.episode import Call, EpisodeRunner, Finished, call_reward


@dataclass
class ExampleState:
    step: int
    left: int                                           # episodes not finished
    agent_left: dict[str, int]                          # agent -> episodes not finished nor settled it
    calls: list[tuple[Node, int, float]] = field(default_factory=list)   # (node, episode, reward)


class ReplayMismatch(StoreInconsistent):
    """A replayed call asks another prompt than the journal holds: the journal cannot be
    replayed by this episode function (one line; ranks/job.py reports it as a store error,
    and the re-open's repairs are put back: Journaled.reload)."""


class EpisodeTree(NodeQueues):
    """The episodes of all live steps and per-agent queues (pending, ready)."""

    def __init__(self, cfg: Config, task, runner: EpisodeRunner | None = None):
        self.cfg, self.task = cfg, task
        self.agents = cfg.agent_names
        w = cfg.workflow
        self.n_in, self.group = w.inputs_per_step, w.group_size
        self.runner = runner or task.runner(cfg)
        self.nodes: dict[tuple[str, str], Node] = {}
        self.pending: dict[str, deque[Node]] = {agent: deque() for agent in self.agents}
        self.ready: dict[str, dict[int, list[Node]]] = {agent: defaultdict(list) for agent in self.agents}
        self.turn_left: dict = {}                          # no turns: the sync barrier is per step
        self.steps_admitted: set[int] = set()
        self.examples: dict[int, ExampleState] = {}        # example id -> its episodes
        self.step_left: dict[int, int] = {}                # step -> examples not finished
        self.agent_step_left: dict[int, dict[str, int]] = {}   # step -> agent -> examples not done with it
        self.calls_of: dict[int, dict[str, int]] = {}      # step -> agent -> calls (all episodes)
        self.call_of: dict[int, Call] = {}                 # id(node) -> its call in flight
        self.resp_len_mean = {agent: float(w.max_new_tokens) / 2 for agent in self.agents}
        self.journal_ready: set[int] = set()               # id()s of nodes the journal has READY
        self.failed: list[Finished] = []                   # episodes that raised
        self.failures = EpisodeFailures(w.max_failure_rate, self.n_in * self.group)
        self.drop_failed = w.on_error == "drop"
        self.dropped_of: dict[int, dict[str, int]] = {}    # step -> agent -> calls dropped
        self.doomed: set[int] = set()                      # id()s of calls to drop at their reply
        self.dropping: list[Node] = []                     # generated calls dropped, for Changes
        # step -> examples a salvage lost whole in a step some agent's checkpoint already
        # holds: no weights of that step are left to replay them, so the step goes on without
        self.lost_inputs: dict[int, set[int]] = {}
        self.recorded: set[tuple[int, int]] = set()        # (example, episode) with an /episodes row

    # -- creating work -------------------------------------------------------------------
    def admit_step(self, step: int) -> Changes:
        """Start `step`'s episodes. Its READY changes are the journal's too: running the
        episodes' loop to start them also ends earlier episodes whose tool or worker result
        came in since the last poll (an in-process pool's result is queued on the loop from
        its executor's thread), making their calls READY here (issue 35)."""
        if step in self.steps_admitted:
            return Changes()
        return self._start_step(step)

    def _start_step(self, step: int) -> Changes:
        """Start the episodes of `step`'s examples and run them until they wait; returns
        the nodes made READY or DROPPED (on a replay: calls the journal answered)."""
        self.steps_admitted.add(step)
        lost = self.lost_inputs.get(step, set())
        self.step_left[step] = self.n_in - len(lost)
        self.agent_step_left[step] = dict.fromkeys(self.agents, self.n_in - len(lost))
        self.calls_of[step] = dict.fromkeys(self.agents, 0)
        self.dropped_of[step] = dict.fromkeys(self.agents, 0)
        for example_id, example in self.task.stream.batch(step, self.n_in):
            if example_id in lost:
                continue
            self.examples[example_id] = ExampleState(step, self.group, dict.fromkeys(self.agents, self.group))
            for e in range(self.group):
                self.runner.start(step, example_id, e, example)
        return self.advance()

    def advance(self) -> Changes:
        """Step the episodes; queue their new calls (answering replayed ones from the
        journal at once) and score finished examples. Returns the READY changes."""
        ch = Changes()
        while True:
            self.runner.step()
            calls, done = self.runner.take()
            settled = self.runner.take_settled()
            if not calls and not done and not settled:
                return ch
            for call in calls:
                self._new_call(call)
            for ctx, agent in settled:
                ch.ready += self._agent_done(ctx, agent, ctx.settled, error=False)
            for f in done:
                ch.ready += self._episode_done(f)
            ch.dropped, self.dropping = ch.dropped + self.dropping, []

    def _new_call(self, call: Call) -> None:
        ctx = call.episode
        node = Node(call.agent, call.index, ctx.step, ctx.example_id, ctx.episode, None, [], None)
        node.prompt = call.prompt
        node.retokenized, node.prefill_len = int(call.retokenized), call.prefill_len
        p = call.parent
        node.parent_call = "" if p is None else f"{p.agent}/{p.episode.example_id}_{p.index}_{p.episode.episode}"
        self.calls_of[ctx.step][call.agent] += 1
        key = (node.agent, node.sample_id)
        old = self.nodes.get(key)
        if old is not None and old.response is not None:        # replay: answered already
            if list(old.prompt) != list(call.prompt):
                raise ReplayMismatch(
                    f"episode replay: call {node.sample_id} of agent {node.agent} has a prompt of "
                    f"{len(call.prompt)} tokens, {len(old.prompt)} when first run: the episode "
                    "function must be deterministic given its replies (use ctx.rng)")
            old.parent_call = node.parent_call
            call.done(list(old.response), self.task.stop_tokens)
            return
        self.nodes[key] = node
        self.call_of[id(node)] = call
        self.pending[node.agent].append(node)

    def _episode_done(self, f: Finished) -> list[Node]:
        ctx = f.ctx
        if f.failure is not None:
            self.failed.append(f)
            self.failures.add(ctx.step, ctx.example_id, ctx.episode, f.failure)
        st = self.examples[ctx.example_id]
        ready = []
        for agent in self.agents:
            if agent not in ctx.settled:
                ready += self._agent_done(ctx, agent, f.rewards, f.failure is not None)
        st.left -= 1
        if not st.left:
            self.step_left[st.step] -= 1
            if not self.step_left[st.step]:
                self.failures.step_done(st.step)
        return ready

    def _agent_done(self, ctx, agent: str, rewards: dict, error: bool) -> list[Node]:
        """`agent` is done in episode `ctx` (settled, or the episode ended): its calls get
        their rewards (if the episode failed: dropped, or 0 by workflow.on_error); once every
        episode of the example is done with the agent, its calls of the example become READY."""
        st = self.examples[ctx.example_id]
        for i in range(ctx.calls.get(agent, 0)):
            node = self.nodes[(agent, f"{ctx.example_id}_{i}_{ctx.episode}")]
            if not (error and self.drop_failed and self._drop(node)):
                st.calls.append((node, ctx.episode, 0.0 if error else call_reward(rewards, agent, i)))
        st.agent_left[agent] -= 1
        if st.agent_left[agent]:
            return []
        self.agent_step_left[st.step][agent] -= 1
        return self._agent_ready(st, agent)

    def _drop(self, node: Node) -> bool:
        """Leave a failed episode's call out of training (False: it cannot be, a call a
        trainer holds from before a resume with another on_error: it keeps reward 0)."""
        if node.status == CONSUMED:
            return False
        self.dropped_of[node.step][node.agent] += 1
        if node.status == GENERATED:             # journalled READY before a resume: now DROPPED
            node.status = DROPPED
            self.journal_ready.discard(id(node))
            self.dropping.append(node)
        elif node.status == -1 and node in self.pending[node.agent]:
            self.pending[node.agent].remove(node)     # never generated: no row
            self.call_of.pop(id(node))
            node.status = DROPPED
        elif node.status == -1:
            self.doomed.add(id(node))            # on a replica: dropped when its reply comes
        return True

    def _agent_ready(self, st: ExampleState, agent: str) -> list[Node]:
        ready = []
        mine = [(n, e, r) for n, e, r in st.calls if n.agent == agent]
        from flexmarl_hpc.learn.grpo import call_advantages  # torch: not at import (tests/unit/test_imports.py)
        adv = call_advantages([(e, n.turn, r) for n, e, r in mine])
        for (n, _, r), a in zip(mine, adv):
            n.reward, n.advantage = r, float(a)
            if n.status == GENERATED:
                n.status = READY
                if id(n) in self.journal_ready:      # READY in the file before a resume
                    self.journal_ready.discard(id(n))
                else:
                    ready.append(n)
            if n.status == READY:
                self.ready[agent][n.step].append(n)
        return ready

    def request(self, node: Node, version: int) -> tuple:
        call = self.call_of[id(node)]
        req = (node.sample_id, node.prompt, self.request_seed(node, version), call.max_tokens, 0)
        return req if call.sampling is None else (*req, call.sampling)

    # -- results -------------------------------------------------------------------------
    def record_generation(self, batch: list[tuple[Node, list[int], list[float]]], version: int,
                          replica: int) -> Changes:
        ch = Changes()
        for node, toks, lps in batch:
            node.response, node.logprobs = list(toks), list(lps)
            node.version, node.replica, node.status = version, replica, GENERATED
            ch.generated.append(node)
            mean = self.resp_len_mean[node.agent]
            self.resp_len_mean[node.agent] = 0.95 * mean + 0.05 * len(toks)
            call = self.call_of.pop(id(node))
            if id(node) in self.doomed or node.reward is not None:
                self._late(node, ch)             # its episode ended while it was generated
                continue
            call.done(node.response, self.task.stop_tokens)
        more = self.advance()
        ch.ready += more.ready
        ch.dropped += more.dropped
        return ch

    def _late(self, node: Node, ch: Changes) -> None:
        """A call whose episode failed while it was in flight: dropped, or (on_error zero,
        its reward 0 and advantage set with its group's) READY now."""
        if id(node) in self.doomed:
            self.doomed.discard(id(node))
            node.status = DROPPED
            ch.dropped.append(node)
        else:
            node.status = READY
            self.ready[node.agent][node.step].append(node)
            ch.ready.append(node)

    def waiting(self) -> bool:
        """Some episode waits on a tool or a timer: the loop must not block on replies."""
        return self.runner.waiting()

    def poll(self) -> Changes:
        """Episodes waiting on tools or timers: step them (the orchestrator calls this every
        round; cheap when none waits)."""
        return self.advance() if self.runner.waiting() else Changes()

    # -- training ------------------------------------------------------------------------
    def batch_of(self, agent: str, step: int) -> int | None:
        """`agent`'s samples of `step`, once all its episodes have finished or settled it
        (else None)."""
        if self.agent_step_left.get(step, {}).get(agent, 1):
            return None
        return self.calls_of[step][agent] - self.dropped_of[step][agent]

    def loss_scale(self, agent: str, step: int) -> float:
        return 1.0 / (self.n_in * self.group)

    # -- resume --------------------------------------------------------------------------
    def restore(self, nodes: list[Node], first_step: int, versions: dict[str, int]) -> tuple[list[Node], Changes]:
        """Replay the episodes of steps >= first_step over the journalled calls (see the
        module docstring); consumed calls the trainers do not have go back to READY."""
        requeue = []
        for n in nodes:
            if n.status == CONSUMED and n.trainer_step >= versions[n.agent]:
                n.status, n.trainer_step = GENERATED, -1
                requeue.append(n)
            elif n.status == READY:
                n.status = GENERATED             # READY again when its example's replay ends,
                self.journal_ready.add(id(n))    # which may be after this returns (tools)
            self.nodes[(n.agent, n.sample_id)] = n
        last = max((n.step for n in nodes), default=first_step - 1)
        self._find_lost(nodes, first_step, max(versions.values(), default=0))
        last = max([last, *self.lost_inputs])
        ch = Changes()
        for step in range(first_step, last + 1):
            more = self._start_step(step)
            ch.ready += more.ready
            ch.dropped += more.dropped
        # a journalled call no replayed episode asks for (only a nondeterministic episode
        # could) stays GENERATED in the file and is never trained
        return requeue, ch

    def _find_lost(self, nodes: list[Node], first_step: int, ahead: int) -> None:
        """Examples of steps before `ahead` (the furthest restored version) with no call row
        and no /episodes row: an agent trained those steps, so each of their examples ran;
        one without a trace was lost whole (salvage drops an example's calls and episodes
        together). Replaying it would need weights of its step that agent no longer has, so
        the step goes on without it (its batch smaller by its calls, as tree.Tree does).
        Later steps' missing examples are replayed from the start, as after any kill."""
        have = {n.input_id for n in nodes} | {i for i, _ in self.recorded}
        for step in range(first_step, ahead):
            gone = {i for i, _ in self.task.stream.batch(step, self.n_in)} - have
            if gone:
                self.lost_inputs[step] = gone

    def close(self) -> None:
        """End the episodes' loop and its tool workers."""
        self.runner.close()

    def forget_step(self, step: int) -> None:
        for key in [k for k, n in self.nodes.items() if n.step == step]:
            del self.nodes[key]
        for agent in self.agents:
            self.ready[agent].pop(step, None)
        for i in [i for i, st in self.examples.items() if st.step == step]:
            del self.examples[i]
        self.step_left.pop(step, None)
        self.agent_step_left.pop(step, None)
        self.calls_of.pop(step, None)
        self.dropped_of.pop(step, None)
        self.failures.counts.pop(step, None)
        self.failures.first.pop(step, None)
        self.lost_inputs.pop(step, None)
