"""The real Orchestrator (with the real scheduler, Experience, workflow and HDF5 store),
driven in one process through a FakeTransport whose scripted workers answer at once: the
commands it emits, without MPI."""
from __future__ import annotations

from collections import Counter

import h5py
import numpy as np
import pytest

from flexmarl_hpc.runtime import messages
from flexmarl_hpc.workflows.build import build_task
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.config.layout import ROLLOUT
from flexmarl_hpc.config.plan import resolve
from flexmarl_hpc.runtime.requeue import EXIT_REQUEUE
from flexmarl_hpc.orchestrator.loop import Orchestrator
from flexmarl_hpc.store.tables import StoreFile
from flexmarl_hpc.runtime.transport import Aborted, FakeTransport
from tests.conftest import ROOT

STEPS = 3


class ScriptedWorkers:
    """Replicas that hold what they were synced to and answer with tokens the task allows
    (seeded by each request), trainer groups that count their micro-batches. `hang` names
    a command kind that is never answered."""

    def __init__(self, cfg, task, layout, hang: type | None = None):
        self.task, self.layout, self.hang = task, layout, hang
        self.held: dict[tuple[int, str], int] = {}
        self.version = {a: 0 for a in cfg.agent_names}

    def __call__(self, rank: int, cmd: messages.Command):
        role, index = self.layout.role_of(rank)
        if isinstance(cmd, self.hang or ()):
            return []
        if isinstance(cmd, messages.Sync):
            if role == ROLLOUT:
                self.held[rank, cmd.agent] = cmd.version
                return [(rank, messages.Synced(index, cmd.agent, cmd.version))]
            return [(rank, messages.TrainerSynced(cmd.agent, cmd.version))]
        if isinstance(cmd, messages.Generate):
            assert self.held.get((rank, cmd.agent)) == cmd.version, "generate before its weights"
            return [(rank, messages.Generated(cmd.batch_id, [self.answer(r) for r in cmd.requests],
                                       intervals=[("generate", cmd.agent, 0.0, 0.0)]))]
        if isinstance(cmd, messages.Train):
            if not cmd.last:
                return [(rank, messages.Trained(cmd.agent, cmd.step))]
            self.version[cmd.agent] = cmd.step + 1
            return [(rank, messages.Stepped(cmd.agent, cmd.step + 1, {"loss": 0.0, "grad_norm": 1.0}))]
        if isinstance(cmd, messages.Checkpoint):
            return [(rank, messages.Checkpointed(cmd.agents))]
        if isinstance(cmd, messages.Move):
            return [(rank, messages.Moved(cmd.agent))]
        if isinstance(cmd, messages.Stop):
            ranks = [rank] if role == ROLLOUT else self.layout.group_ranks(index)
            return [(r, messages.Stopped(index if role == ROLLOUT else -1)) for r in ranks]
        raise AssertionError(f"unexpected command {cmd.kind}")

    def answer(self, req: messages.Request) -> tuple[list[int], list[float]]:
        sample_id, prompt, seed, max_new, turn = req
        mask = self.task.allowed_tokens(turn)
        ids = np.arange(len(self.task.vocab)) if mask is None else np.nonzero(mask.numpy())[0]
        toks = np.random.default_rng(seed).choice(ids, size=max_new).tolist()
        return toks, [-float(np.log(len(ids)))] * max_new


def make(tmp_path, *overrides, hang=None, preempted=lambda: False):
    cfg = load_config(str(ROOT / "configs/local.yaml"),
                      [f"run.output_dir={tmp_path}", f"run.steps={STEPS}", "run.resume=false",
                       "workflow.inputs_per_step=2", "trainer.micro_batch_size=8", "run.eval_every=0",
                       *overrides])
    plan = resolve(cfg)
    task, layout = build_task(cfg), plan.layout
    store = StoreFile(tmp_path / "run.h5", cfg.agent_names, {})
    transport = FakeTransport(ScriptedWorkers(cfg, task, layout, hang))
    lines: list[str] = []
    orch = Orchestrator(plan, task, transport, store, preempted=preempted, log=lines.append)
    return orch, transport, store, lines


@pytest.mark.parametrize("mode", ["sync", "flex"])
def test_every_sample_is_trained_once_per_step_in_order(tmp_path, mode):
    orch, transport, store, _ = make(tmp_path, f"run.mode={mode}")
    try:
        assert orch.run() == 0
    finally:
        store.close()
    sent = transport.sent
    batch = orch.exp.batch_size
    for agent in orch.agents:
        trains = [c for _, c in sent if isinstance(c, messages.Train) and c.agent == agent]
        for step in range(STEPS):
            mine = [c for c in trains if c.step == step]
            assert sum(len(c.arrays["input_ids"]) for c in mine) == batch[agent]
            assert [c.last for c in mine] == [False] * (len(mine) - 1) + [True]
            assert all(c.scale == 1.0 / batch[agent] for c in mine)
        assert [c.step for c in trains] == sorted(c.step for c in trains), "steps out of order"
    # a version is generated with only after it was pushed to that replica
    synced = set()
    for rank, c in sent:
        if isinstance(c, messages.Sync):
            synced.add((rank, c.agent, c.version))
        elif isinstance(c, messages.Generate):
            assert (rank, c.agent, c.version) in synced
    # it ends with a checkpoint of every agent, then a stop to each replica and group leader
    kinds = [c.kind for _, c in sent]
    leaders, workers = len({s.leader for s in orch.state.values()}), orch.layout.replicas + orch.layout.groups
    assert kinds[-leaders - workers:] == ["checkpoint"] * leaders + ["stop"] * workers
    assert Counter(kinds)["stop"] == workers
    assert {a for _, c in sent if isinstance(c, messages.Checkpoint) for a in c.agents} == set(orch.agents)
    assert all(s.version == STEPS for s in orch.state.values())


def test_sync_mode_keeps_the_barriers_of_the_baseline(tmp_path, mode="sync"):
    """No generation at version v+1 while some agent is still at v, and no micro-batch of a
    step until all of its generation is done (small batches: flex would overlap them)."""
    orch, transport, store, _ = make(tmp_path, f"run.mode={mode}", "rollout.max_batch=8")
    try:
        orch.run()
    finally:
        store.close()
    at = {a: 0 for a in orch.agents}
    last_generate = {}
    for i, (_, c) in enumerate(transport.sent):
        if isinstance(c, messages.Train) and c.last:
            at[c.agent] = c.step + 1
        elif isinstance(c, messages.Generate):
            assert c.version <= min(at.values()), f"{c.agent} v{c.version} generated before the barrier"
            last_generate[c.version] = i
    first_train = {}
    for i, (_, c) in enumerate(transport.sent):
        if isinstance(c, messages.Train):
            first_train.setdefault(c.step, i)
    assert all(first_train[s] > last_generate[s] for s in range(STEPS)), "training overlapped generation"


def test_a_finished_step_sends_its_weight_sync_before_its_checkpoint_and_log_line(tmp_path):
    """The bookkeeping of a finished step (its /steps row, its checkpoint, the log line) waits
    until schedule() has sent the weight sync the step unlocks: a checkpoint would hold the
    trainer, and the log line with its full store flush delayed the sync by ~3 ms a step.
    (flex with a replica per agent: each sync can go out as soon as its step ends; sync mode
    holds it until every agent has stepped, and a shared replica until it is rebound.)"""
    orch, transport, store, _ = make(tmp_path, "run.mode=flex", "rollout.replicas=2",
                                     "run.checkpoint_every=1", "run.log_every=1")
    logged: list[tuple[int, str]] = []
    orch.log = lambda line: logged.append((len(transport.sent), line))
    try:
        assert orch.run() == 0
    finally:
        store.close()
    sent = transport.sent
    for agent in orch.agents:
        leader = orch.state[agent].leader
        for v in range(1, STEPS):
            stepped = next(i for i, (_, c) in enumerate(sent)
                           if isinstance(c, messages.Train) and c.agent == agent and c.step == v - 1 and c.last)
            ckpt = next(i for i, (_, c) in enumerate(sent)
                        if i > stepped and isinstance(c, messages.Checkpoint) and agent in c.agents)
            sync = next(i for i, (r, c) in enumerate(sent)
                        if r == leader and isinstance(c, messages.Sync) and c.agent == agent and c.version == v)
            assert stepped < sync < ckpt, f"{agent} v{v}: sync at {sync}, checkpoint at {ckpt}"
    # the log line of global step s comes after the syncs of version s + 1 of every agent
    for s in range(STEPS - 1):
        at = next(n for n, line in logged if line.startswith(f"step {s + 1:4d}/"))
        syncs = [i for i, (_, c) in enumerate(sent) if isinstance(c, messages.Sync) and c.version == s + 1]
        assert syncs and max(syncs) < at, f"step {s + 1} logged at {at}, its syncs at {syncs}"


class SlowTrainer(ScriptedWorkers):
    """`slow`'s trainer reports each optimizer step only once the orchestrator has nothing
    else to handle (PatientTransport): until the orchestrator has that reply, the agent is
    still training step s. Records the other agents' batches of a later step sent meanwhile."""

    def __init__(self, *a, slow: str):
        super().__init__(*a)
        self.slow, self.parked, self.told = slow, [], 0
        self.ahead: list[tuple[str, int]] = []

    def __call__(self, rank, cmd):
        out = super().__call__(rank, cmd)
        if isinstance(cmd, messages.Train) and cmd.last and cmd.agent == self.slow:
            self.parked, out = out, []
        elif isinstance(cmd, messages.Generate) and cmd.agent != self.slow and cmd.version > self.told:
            self.ahead.append((cmd.agent, cmd.version))
        return out


class PatientTransport(FakeTransport):
    def receive(self, timeout=None):
        w = self.respond
        if not self.queue:
            self.queue.extend(w.parked)
            w.parked = []
        return self._read(super().receive(timeout))

    def poll(self):
        m = super().poll()
        return m if m is None else self._read(m)

    def _read(self, m):
        """The orchestrator now has this reply: a Stepped of the slow agent ends its step."""
        if isinstance(m[1], messages.Stepped) and m[1].agent == self.respond.slow:
            self.respond.told = m[1].version
        return m


@pytest.mark.parametrize("config,slow", [("configs/local.yaml", "listener"),
                                         ("configs/skewed.yaml", "writer")])
def test_an_agent_that_finished_its_step_samples_the_next_while_another_still_trains(
        tmp_path, config, slow):
    """flex, max_staleness=0: step s+1 is admitted once some agent is at version s+1, so that
    agent generates its part of it while a slower one still trains step s (before, nothing
    of step s+1 was sampled until every agent had stepped). Each request is still sampled
    at its own agent's version, equal to its step."""
    cfg = load_config(str(ROOT / config), [f"run.output_dir={tmp_path}", f"run.steps={STEPS}",
                                           "run.resume=false", "workflow.inputs_per_step=2",
                                           "trainer.micro_batch_size=8", "run.eval_every=0",
                                           "run.mode=flex", "rollout.replicas=3"])
    plan = resolve(cfg)
    task, layout = build_task(cfg), plan.layout
    store = StoreFile(tmp_path / "run.h5", cfg.agent_names, {})
    workers = SlowTrainer(cfg, task, layout, slow=slow)
    transport = PatientTransport(workers)
    try:
        assert Orchestrator(plan, task, transport, store, log=lambda _: None).run() == 0
    finally:
        store.close()
    assert workers.ahead, "no agent sampled its next step while the slow one trained"
    with h5py.File(tmp_path / "run.h5", "r") as f:
        for agent in cfg.agent_names:
            rows = f[f"samples/{agent}"][:]
            assert len(rows) and np.array_equal(rows["step"], rows["policy_version"]), agent


def test_a_generate_batch_goes_out_behind_its_replicas_weight_sync(tmp_path):
    """A replica syncing to the version its next batch needs gets that batch at once, queued
    behind the sync (a replica runs its commands in order), not a round trip after its
    Synced reply; one batch at most, and never behind a sync to another version."""
    orch, transport, store, _ = make(tmp_path, "run.mode=flex", "rollout.replicas=2")
    at_send: list[tuple[messages.Command, tuple]] = []
    send = transport.send

    def recording_send(rank, msg):
        if isinstance(msg, messages.Generate):
            r = orch.replicas[rank - 1]
            at_send.append((msg, (r.busy, getattr(r, "syncing_to", None), getattr(r, "queued", False))))
        send(rank, msg)
    transport.send = recording_send
    try:
        assert orch.run() == 0
    finally:
        store.close()
    behind = [(m, st) for m, st in at_send if st[0] == "sync"]
    assert behind, "every batch waited for its replica's Synced reply"
    for m, (_, syncing_to, queued) in behind:
        assert syncing_to == (m.agent, m.version) and not queued
    assert all(s.version == STEPS for s in orch.state.values())


def test_a_hung_replica_ends_the_job_with_the_requeue_code(tmp_path):
    orch, transport, store, lines = make(tmp_path, "run.worker_timeout=0.2", hang=messages.Generate)
    try:
        with pytest.raises(Aborted) as e:
            orch.run()
    finally:
        store.close()
    assert e.value.code == EXIT_REQUEUE
    assert any("replica 0 (rank 1): no answer to generate batch 1" in ln for ln in lines), lines
    # the trainer groups still answer: both agents are checkpointed before the exit
    assert {a for _, c in transport.sent if isinstance(c, messages.Checkpoint) for a in c.agents} == set(orch.agents)


class TimedOutSync(ScriptedWorkers):
    """The sync of `agent` v1: its leader reports SyncTimedOut (weight_sync.timeout_s passed,
    runtime/deadline.py), the replicas it went to never answer (the member that never came)."""

    def __init__(self, cfg, task, layout, agent):
        super().__init__(cfg, task, layout)
        self.agent, self.hung = agent, set()

    def __call__(self, rank, cmd):
        if rank in self.hung:
            return []
        if isinstance(cmd, messages.Sync) and cmd.agent == self.agent and cmd.version == 1:
            if self.layout.role_of(rank)[0] == ROLLOUT:
                self.hung.add(rank)
                return []
            return [(rank, messages.SyncTimedOut(cmd.agent, 1, tuple(cmd.members), "the rendezvous not done"))]
        return super().__call__(rank, cmd)


def test_a_sync_timeout_checkpoints_and_ends_the_job_with_the_requeue_code(tmp_path):
    """Long before run.worker_timeout: the leader that gave up is free again, so every agent,
    the one whose sync hung included, is checkpointed; then exit 75."""
    orch, transport, store, lines = make(tmp_path)
    assert orch.cfg.run.worker_timeout == 1800
    agent = orch.agents[0]
    transport.respond = TimedOutSync(orch.cfg, orch.task, orch.layout, agent)
    try:
        with pytest.raises(Aborted) as e:
            orch.run()
    finally:
        store.close()
    assert e.value.code == EXIT_REQUEUE
    leader = orch.state[agent].leader
    assert any(f"(rank {leader}): gave up on the weight sync of agent {agent} v1 over ranks [{leader}, " in ln
               and "the rendezvous not done" in ln for ln in lines), lines
    assert {a for _, c in transport.sent if isinstance(c, messages.Checkpoint) for a in c.agents} == set(orch.agents)


def test_messages_round_trip_without_copying_arrays():
    arrays = {"input_ids": np.zeros((2, 3), np.int64)}
    for msg in (messages.Train("a", 1, arrays, 0.5, True), messages.Stopped(-1, intervals=[("wait", "", 0.0, 1.0)]),
                messages.Generate(3, "a", 0, [("s", [1, 2], 7, 2, 0)]), messages.Intervals()):
        back = messages.decode(messages.encode(msg))
        assert type(back) is type(msg) and back.kind == msg.kind
        assert all(getattr(back, k) is getattr(msg, k) for k in msg.__dataclass_fields__)
    with pytest.raises(ValueError, match="not a message"):
        messages.decode(("trained", "a"))


def test_evaluation_batches_carry_their_own_sampling_params(tmp_path):
    """run.eval_every: held-out batches go to the replicas as Generate commands with greedy
    (or sampled) params of their own; training batches use the run's (params None)."""
    orch, transport, store, lines = make(tmp_path, "run.eval_every=1", "run.eval_inputs=2")
    try:
        assert orch.run() == 0
    finally:
        store.close()
    gens = [c for _, c in transport.sent if isinstance(c, messages.Generate)]
    evals = [c for c in gens if c.params is not None]
    assert evals and any(c.params.temperature == 0.0 for c in evals)
    assert len(evals) < len(gens)
    assert any(ln.startswith("eval at step") for ln in lines), lines


def stalled(tmp_path, monkeypatch, preempted=None):
    """A run that waits for a listener sample no one will make (issue 38's resume waited on
    samples no version could sample): every command answered, nothing outstanding."""
    import flexmarl_hpc.orchestrator.failures as loop
    monkeypatch.setattr(loop, "SIGNAL_CHECK_S", 0.05, raising=False)
    orch, transport, store, lines = make(tmp_path, preempted=preempted or (lambda: False))
    orch.exp.batch_size["listener"] += 1          # one sample more than its step has
    return orch, transport, store, lines


def test_a_run_with_nothing_outstanding_stops_as_stalled_instead_of_waiting_for_ever(tmp_path, monkeypatch):
    import flexmarl_hpc.orchestrator.failures as loop
    from flexmarl_hpc.orchestrator.failures import EXIT_STALLED
    monkeypatch.setattr(loop, "STALL_S", 0.3, raising=False)
    orch, transport, store, lines = stalled(tmp_path, monkeypatch)
    try:
        assert orch.run() == EXIT_STALLED
    finally:
        store.close()
    line = next(ln for ln in lines if ln.startswith("stalled:"))
    assert "listener at version 0:" in line and f"batch {orch.exp.batch_size['listener']}" in line, line
    assert {a for _, c in transport.sent if isinstance(c, messages.Checkpoint) for a in c.agents} == set(orch.agents)
    assert sum(isinstance(c, messages.Stop) for _, c in transport.sent) > 0


def test_a_preemption_signal_during_a_stall_is_acted_on_within_a_second(tmp_path, monkeypatch):
    """The signal handler only sets a flag and Python resumes an interrupted epoll wait:
    the loop must look at the flag while it waits (issue 38: SIGTERM ignored for 65 s)."""
    import time
    import flexmarl_hpc.orchestrator.failures as loop
    monkeypatch.setattr(loop, "STALL_S", 3600.0, raising=False)
    monkeypatch.setattr(loop, "SIGNAL_CHECK_S", 1.0, raising=False)
    t_signal = [None]

    def preempted():                              # "SIGTERM" 0.5 s into the stall
        if t_signal[0] is None and orch.state["speaker"].version >= 1 and not orch.batches:
            t_signal[0] = time.monotonic() + 0.5
        return t_signal[0] is not None and time.monotonic() >= t_signal[0]

    orch, transport, store, lines = stalled(tmp_path, monkeypatch, preempted)
    try:
        assert orch.run() == EXIT_REQUEUE
    finally:
        store.close()
    assert time.monotonic() - t_signal[0] < 1.5
    assert any(ln.startswith("preemption signal") for ln in lines), lines
