"""Worker rank loops: a rollout replica, and a trainer group (leader + members).

Workers are passive: they execute the orchestrator's commands in arrival order and
report back, with the busy intervals they spent (activity, agent, t0, t1) so the store
can account for every rank's time. Waiting is never a spin (see comm.py).
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from flexmarl_hpc import faults
from flexmarl_hpc.runtime import comm
from flexmarl_hpc.runtime import messages
from flexmarl_hpc.store.checkpoint import load_latest, save_checkpoint
from flexmarl_hpc.rollout.base import GenRequest
from flexmarl_hpc.learn.sampling import SamplingParams
from flexmarl_hpc.runtime.state_swap import StateMover
from flexmarl_hpc.trainer.base import train_micro
from flexmarl_hpc.runtime.doorbell import Doorbell
from flexmarl_hpc.runtime.liveness import Liveness
from flexmarl_hpc.runtime.microbatch import microbatch_from_arrays
from flexmarl_hpc.runtime.timing import WorkerClock
from flexmarl_hpc.runtime.transport import recv_command, send_reply
from flexmarl_hpc.runtime.deadline import CollectiveTimeout, Deadline
from flexmarl_hpc.runtime.weight_sync import (Destination, SyncPlan, RemoteGroup, SyncChannels, layout_of, plan_buckets,
                                              receive_weights, row_pieces, send_weights)


def replica_channels(world: MPI.Comm, engine, sync_backend: str = "auto", sync_timeout_s: float = 0.0,
                     sync_groups=(), setup: Deadline | None = None) -> SyncChannels:
    """A replica's sync channels, its groups made (an engine whose own workers receive,
    vLLM's on GPUs, joins them); `setup`: their set-up's one deadline (start-up)."""
    channels = SyncChannels(world, sync_backend, timeout_s=sync_timeout_s)
    channels.open(sync_groups, None if channels.backend == "mpi" else lambda g: engine.remote(g.agents[0]), setup)
    return channels


def trainer_channels(world: MPI.Comm, sync_backend: str = "auto", sync_timeout_s: float = 0.0,
                     sync_groups=(), setup: Deadline | None = None) -> SyncChannels:
    """A trainer rank's sync channels, its groups made; `setup` as replica_channels'."""
    channels = SyncChannels(world, sync_backend, timeout_s=sync_timeout_s)
    channels.open(sync_groups, None, setup)
    return channels


def replica_loop(world: MPI.Comm, orch: int, index: int, engine, params: SamplingParams,
                 bucket_bytes: int, sync_backend: str = "auto", bell: Doorbell | None = None,
                 live: Liveness | None = None, sync_timeout_s: float = 0.0, sync_groups=(),
                 channels: SyncChannels | None = None) -> int:
    """`live`: disarmed at the Stop, so the orchestrator's end that follows is no loss.
    `sync_timeout_s`: weight_sync.timeout_s (a sync past it is reported, SyncTimedOut).
    `sync_groups`: config/sync_groups.sync_groups, the job's (trainer group, pool) groups,
    made here at start unless `channels` (replica_channels) already holds them."""
    if channels is None:
        channels = replica_channels(world, engine, sync_backend, sync_timeout_s, sync_groups)
    clock = WorkerClock()
    failed: set[str] = set()                 # agents whose sync this replica gave up on
    while True:
        cmd = recv_command(world, orch, bell)
        t0 = clock.now()
        if isinstance(cmd, messages.Generate) and cmd.agent in failed:
            continue      # queued behind that sync; the orchestrator is ending the job (SyncTimedOut)
        if isinstance(cmd, messages.Generate):
            agent, version = cmd.agent, cmd.version
            if engine.version(agent) != version:
                raise RuntimeError(f"replica {index}: asked for {agent} v{version}, holds "
                                   f"v{engine.version(agent)}")
            # an evaluation batch brings its own params (greedy), training uses the run's
            gens = engine.generate(agent, [GenRequest(*r) for r in cmd.requests], cmd.params or params)
            clock.mark("generate", agent, t0)
            send_reply(world, orch, messages.Generated(cmd.batch_id, [(g.tokens, g.logprobs) for g in gens],
                                                intervals=clock.drain()), bell)
        elif isinstance(cmd, messages.Sync):
            agent = cmd.agent
            t = [t0]
            faults.hit("sync_join")
            try:
                v = replica_sync(channels, engine, cmd, index, clock, t)
            except CollectiveTimeout as e:
                failed.add(agent)
                clock.mark("sync", agent, t[0])
                reply = sync_timed_out(world.Get_rank(), cmd, e)
                send_reply(world, orch, replace(reply, intervals=clock.drain()), bell)
                continue
            clock.mark("sync", agent, t[0])
            dropped = tuple(engine.take_dropped())
            send_reply(world, orch, messages.Synced(index, agent, v, dropped, intervals=clock.drain()), bell)
        elif isinstance(cmd, messages.Stop):
            if live is not None:
                live.disarm()
            channels.close()
            clock.waited(t0)
            send_reply(world, orch, messages.Stopped(index, intervals=clock.drain()), bell)
            return cmd.code
        else:
            raise ValueError(f"replica {index}: unknown command {cmd.kind!r}")


def replica_sync(channels: SyncChannels, engine, cmd: messages.Sync, index: int, clock: WorkerClock,
                 t: list[float]) -> int:
    """A replica's part of a sync: the plan, then the buckets into the engine as they
    arrive; the version received. CollectiveTimeout past the receivers' deadline."""
    agent = cmd.agent
    pg = channels.pair(cmd.members[0], channels.world.Get_rank()).pg
    if isinstance(pg, RemoteGroup) and not pg.remote.serves(agent):
        raise ValueError(f"replica {index}: agent {agent} runs on another engine than the one whose workers "
                         f"joined this (trainer group, pool) sync group; a pair's agents must share an "
                         f"architecture on vLLM replicas")
    v, _, buckets = receive_weights(channels, tuple(cmd.members))
    t[0] = clock.waited(t[0])
    engine.load_weights(agent, v, buckets)            # bucket by bucket, as they arrive
    for _ in buckets:                                 # every bucket is a collective
        raise RuntimeError(f"replica {index}: the engine left buckets of {agent} v{v} unread")
    return v


class TrainerRank:
    """One rank of a trainer group: a handler per command kind, each returning the reply
    (the leader sends it; the other members send their intervals only)."""

    def __init__(self, world: MPI.Comm, group: MPI.Comm, mover: StateMover, ckpt_dir: Path,
                 bucket_bytes: int, keep_checkpoints: int, channels: SyncChannels,
                 sync_wire: torch.dtype | None) -> None:
        self.world, self.group, self.mover, self.ckpt_dir = world, group, mover, ckpt_dir
        self.bucket_bytes, self.keep_checkpoints = bucket_bytes, keep_checkpoints
        self.channels, self.sync_wire = channels, sync_wire
        self.leader = group.Get_rank() == 0
        self.clock = WorkerClock()
        self.step_stats: dict[str, dict[str, float]] = {}     # per agent, summed over micro-batches
        self.handlers = {messages.Train: self.train, messages.Sync: self.sync,
                         messages.Checkpoint: self.checkpoint, messages.Move: self.move}

    def handle(self, cmd: messages.Command, t0: float) -> messages.Reply:
        handler = self.handlers.get(type(cmd))
        if handler is None:
            raise ValueError(f"trainer: unknown command {cmd.kind!r}")
        return handler(cmd, t0)

    def train(self, cmd: messages.Train, t0: float) -> messages.Reply:
        agent, group = cmd.agent, self.group
        tr = self.mover.trainers[agent]
        if len(cmd.arrays["input_ids"]) == 0:     # a step without samples: next version only
            tr.version += 1
            self.clock.mark("train", agent, t0)
            return messages.Stepped(agent, tr.version, {"empty_step": 1.0})
        mb = tr.share(microbatch_from_arrays(cmd.arrays))      # the backend cuts its own rows
        # at the step's last micro-batch: the optimizer step, then (trainer.ppo_epochs > 1)
        # the replay passes with theirs
        summed = train_micro(tr, mb, cmd.scale, cmd.last, self.step_stats.setdefault(agent, {}),
                             lambda d: group_sum(group, d))
        self.clock.mark("train", agent, t0)
        return messages.Trained(agent, cmd.step) if summed is None else messages.Stepped(agent, tr.version, summed)

    def sync(self, cmd: messages.Sync, t0: float) -> messages.Reply:
        """Every rank of the group: the stage senders stream, the others run the TP gathers."""
        agent, version = cmd.agent, cmd.version
        src = sync_source(self.mover, agent, self.group)
        if src.version != version:
            raise RuntimeError(f"sync of {agent} v{version} but its state is at v{src.version}")
        targets = tuple(cmd.members[1:])
        t = [t0]
        err = None
        with src.ready():
            plan = self.plan(src, targets, agent)
            stage = next((s for s, r in enumerate(src.sync_senders()) if r == self.group.Get_rank()), None)
            dest = Destination(plan)            # the stream assembles its ranges in the buckets
            try:
                send_weights(self.channels, targets, plan, version, stage, src.sync_stream(row_pieces(plan), dest),
                             self.leader, on_rendezvous=lambda: t.__setitem__(0, self.clock.waited(t0)), dest=dest)
            except CollectiveTimeout as e:
                err = e
        self.clock.mark("sync", agent, t[0])
        # a stage sender that gave up is not the leader, who answers: the group learns it
        # (every rank is past its part, so this waits for nobody) and drops the sync's ids
        reason = first_error(self.group, None if err is None else str(err))
        if reason is None:
            return messages.TrainerSynced(agent, version)
        return sync_timed_out(self.world.Get_rank(), cmd, reason)

    def plan(self, src, targets: tuple[int, ...], agent: str) -> SyncPlan:
        """The sync's plan: stages, buckets, senders as world ranks."""
        senders = MPI.Group.Translate_ranks(self.group.Get_group(), src.sync_senders(), self.world.Get_group())
        layouts = src.sync_layouts()
        return SyncPlan(tuple(int(r) for r in senders),
                    tuple(plan_buckets(lay, self.bucket_bytes, self.sync_wire) for lay in layouts))

    def checkpoint(self, cmd: messages.Checkpoint, t0: float) -> messages.Reply:
        for name in cmd.agents:
            tr = trainer_of(self.mover, name)
            if tr is not None:                        # live or shelved: its backend's format
                tr.save_checkpoint(self.ckpt_dir / name, self.keep_checkpoints)
            elif self.leader:                         # parked as a plain state, whole on each rank
                state = self.mover.parked[name]
                save_checkpoint(self.ckpt_dir / name, int(state["version"]), state, self.keep_checkpoints)
        self.clock.mark("checkpoint", ",".join(cmd.agents), t0)
        return messages.Checkpointed(cmd.agents)

    def move(self, cmd: messages.Move, t0: float) -> messages.Reply:
        self.mover.move(cmd.agent, cmd.src, cmd.dst)
        self.clock.mark("swap", cmd.agent, t0)
        return messages.Moved(cmd.agent)

    def answer(self, reply: messages.Reply, orch: int, bell: Doorbell | None) -> None:
        if self.leader:
            send_reply(self.world, orch, replace(reply, intervals=self.clock.drain()), bell)
        else:
            # the other members' intervals go straight to the store too (one small message
            # per command), so utilization counts every rank of a data-parallel group
            send_reply(self.world, orch, messages.Intervals(intervals=self.clock.drain()), bell)


def trainer_loop(world: MPI.Comm, group: MPI.Comm, orch: int, mover: StateMover, ckpt_dir: Path,
                 bucket_bytes: int, keep_checkpoints: int = 3, sync_backend: str = "auto",
                 sync_wire: torch.dtype | None = None, bell: Doorbell | None = None,
                 live: Liveness | None = None, sync_timeout_s: float = 0.0, sync_groups=(),
                 channels: SyncChannels | None = None) -> int:
    """Every rank of a trainer group runs this; rank 0 of `group` talks to the orchestrator
    and forwards each command to the members (a non-spinning broadcast). `mover` holds the
    agents whose state is on this group, live (`mover.trainers`) or parked in host memory.
    `live`: disarmed at the Stop, so the orchestrator's end that follows is no loss.
    `sync_timeout_s`: weight_sync.timeout_s (a sync past it is reported, SyncTimedOut).
    `sync_groups`: the job's (trainer group, pool) sync groups, made here at start unless
    `channels` (trainer_channels) already holds them."""
    if channels is None:
        channels = trainer_channels(world, sync_backend, sync_timeout_s, sync_groups)
    rank = TrainerRank(world, group, mover, ckpt_dir, bucket_bytes, keep_checkpoints, channels, sync_wire)
    while True:
        cmd = group_command(group, recv_command(world, orch, bell) if rank.leader else None)
        t0 = rank.clock.now()
        if isinstance(cmd, messages.Stop):
            if live is not None:
                live.disarm()
            channels.close()
            rank.clock.waited(t0)
            send_reply(world, orch, messages.Stopped(-1, intervals=rank.clock.drain()), bell)   # every rank
            return cmd.code
        rank.answer(rank.handle(cmd, t0), orch, bell)


def group_command(group: MPI.Comm, cmd: messages.Command | None) -> messages.Command:
    """The leader's command (None on the members) on every rank of `group`: its control
    header pickled (bcast_obj: small), a Train's micro-batch as one raw buffer
    (comm.bcast_arrays), so the micro-batch crosses the group once and never as a pickle;
    each rank then takes its share (TrainerBackend.share)."""
    if group.Get_size() == 1:
        return cmd
    arrays = cmd.arrays if isinstance(cmd, messages.Train) else None
    head = (cmd, None) if arrays is None else (replace(cmd, arrays={}), comm.array_meta(arrays))
    cmd, meta = comm.bcast_obj(group, head if group.Get_rank() == 0 else None, 0)
    if meta is None:
        return cmd
    return replace(cmd, arrays=comm.bcast_arrays(group, arrays, meta, 0))


def first_error(group: MPI.Comm, err: str | None) -> str | None:
    """The first rank's error of `group` (None where no rank has one), known to every rank."""
    flags = np.zeros(group.Get_size(), dtype=np.int64)
    flags[group.Get_rank()] = err is not None
    comm.allreduce_sum(group, flags)
    if not flags.any():
        return None
    return comm.bcast_obj(group, err, int(np.flatnonzero(flags)[0]))


def sync_timed_out(rank: int, cmd: messages.Sync, e: Exception | str) -> messages.SyncTimedOut:
    """The reply of a member whose sync passed its deadline (one line on stderr too): it is
    out of the collective (the sets it used are abandoned) and answers again, so the
    orchestrator can still checkpoint through it before it ends the job
    (orchestrator/failures.py: sync_timed_out)."""
    sys.stderr.write(f"[rank {rank}] weight sync of {cmd.agent} v{cmd.version}: {e}\n")
    sys.stderr.flush()
    return messages.SyncTimedOut(cmd.agent, cmd.version, tuple(cmd.members), str(e))


def group_sum(group: MPI.Comm, stats: dict[str, float]) -> dict[str, float]:
    """`stats` summed over the ranks of `group` (the same keys on every rank)."""
    keys = sorted(stats)
    buf = np.array([stats[k] for k in keys], dtype=np.float64)
    comm.allreduce_sum(group, buf)
    return dict(zip(keys, buf.tolist()))


def trainer_of(mover: StateMover, agent: str):
    """The agent's trainer object on this rank, live or shelved (offloaded); None when it is
    parked as a plain state."""
    return mover.trainers.get(agent) or mover.parked.shelf.get(agent)


class _StateSource:
    """A parked state (`state()` format) as a one-stage weight-sync source on the leader."""

    def __init__(self, state: dict[str, torch.Tensor], group: MPI.Comm):
        self.named = {k[6:]: v for k, v in state.items() if k.startswith("model.")}
        self.version, self.group = int(state["version"]), group

    def ready(self):
        return contextlib.nullcontext()

    def sync_layouts(self):
        return [layout_of(self.named)]

    def sync_senders(self) -> list[int]:
        return [0]

    def sync_stream(self, pieces=None, dest=None):
        if self.group.Get_rank() == 0:                  # whole tensors (fill_bucket cuts them)
            yield from self.named.items()


class _TrainerSource:
    """A live or shelved trainer as a weight-sync source (a shelved one is brought onto the
    device for the stream: collective, every group rank syncs)."""

    def __init__(self, tr):
        self.tr, self.version = tr, tr.version

    def ready(self):
        return self.tr.onloaded()

    def sync_layouts(self):
        return self.tr.sync_layouts()

    def sync_senders(self) -> list[int]:
        return self.tr.sync_senders()

    def sync_stream(self, pieces=None, dest=None):
        return self.tr.sync_stream(pieces, dest)


def sync_source(mover: StateMover, agent: str, group: MPI.Comm):
    """What a sync of `agent` streams on this rank: its trainer, live or shelved, or its
    parked state (whose `model.*` tensors the leader sends)."""
    tr = trainer_of(mover, agent)
    if tr is not None:
        return _TrainerSource(tr)
    return _StateSource(mover.parked[agent], group)


def restore_trainers(group: MPI.Comm, mover: StateMover, ckpt_dir: Path) -> None:
    """Load the newest valid checkpoint of each agent this group holds on the leader and hand
    it to every member (live trainers load it, parked states are replaced by it). The
    orchestrator picks the same version (checkpoint.newest_valid), and reports bad ones."""
    for name in sorted(set(mover.trainers) | set(mover.parked)):
        tr = trainer_of(mover, name)
        if tr is not None:                            # live or shelved: its backend's format
            tr.load_checkpoint(ckpt_dir / name, report=lambda line: None)
            continue
        state = load_latest(ckpt_dir / name, report=lambda line: None) if group.Get_rank() == 0 else None
        state = comm.bcast_tensors(group, state, 0)
        if state is not None:
            mover.parked[name] = state
