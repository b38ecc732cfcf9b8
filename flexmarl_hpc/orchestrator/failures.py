"""What the orchestrator does when a worker fails: hangs (a command unanswered for
run.worker_timeout), dies (its liveness socket closes: runtime/liveness.py), a weight sync
passes its deadline (weight_sync.timeout_s: a member reports SyncTimedOut), or rank 0's own
reward function hangs (timing.Watchdog); and when too many episodes fail (an episode
function's bug: exit 1, no requeue).

    failures = FailureHandler(cfg, layout, transport, deadlines, store, exp, state, moving, stops, preempted, log)
    failures.receive(...)                   # the orchestrator's waits, which find failures
    failures.stop_hung(rank, what, secs) / .stop_lost(rank) / .sync_timed_out(rank, msg)
    failures.reward_hung(what, secs)
    failures.stop_preempted() / .stop_failing()     # a clean stop: drained, checkpointed

The handler is composed into the Orchestrator (orchestrator/loop.py), not mixed into it: it
reads the run's state it is handed (the agents' states, the groups' moves, the experience
journal) and acts only through `Stops`, the orchestrator's four actions it may call.

Each says who and what in one line, checkpoints the agents whose trainer groups still
answer, flushes the store and ends the whole job with EXIT_REQUEUE (75: the sbatch
script requeues, and the run resumes from the checkpoints and the store).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from flexmarl_hpc.config.layout import ROLLOUT, TOOLS, RankLayout
from flexmarl_hpc.config.schema import Config
from flexmarl_hpc.runtime import messages, requeue
from flexmarl_hpc.runtime.messages import WorkerLost
from flexmarl_hpc.runtime.requeue import EXIT_REQUEUE

EXIT_EPISODES = 1
"""The exit code of a run stopped by failing episodes (workflow.max_failure_rate)."""
EPISODE_POLL_S = 0.02
"""How often the loop looks at episodes waiting on a tool while no reply arrives."""
SIGNAL_CHECK_S = 1.0
"""Longest wait for a reply before the loop looks at the preemption flag again: a signal's
handler only sets the flag, and Python resumes an interrupted epoll wait by itself."""
STALL_S = 10.0
"""Seconds the orchestrator may wait with no command outstanding anywhere before the run
counts as stalled: no reply can come, so nothing would ever change (issue 38: a resume
waited for samples no version could make, every rank in epoll_wait for good)."""
EXIT_STALLED = 1
"""The exit code of a stalled run (stop_stalled): a bug to report, not a fault to requeue."""


def who(layout: RankLayout, rank: int) -> str:
    """A worker rank by its role, for the log."""
    role, index = layout.role_of(rank)
    if role == ROLLOUT:
        return f"replica {index}"
    if role == TOOLS:
        return f"tool rank {index}"
    return f"trainer group {index} ({'leader' if layout.group_leader(index) == rank else 'member'})"


def checkpointable(state: dict, moving: dict[int, int], layout: RankLayout,
                   rank: int) -> list[str]:
    """Agents whose group can still checkpoint without `rank` (hung or dead): not on its
    trainer group, not on a group moving a state, and (`rank` a replica) not on a group
    with a weight sync in flight: that broadcast may wait for `rank` forever."""
    role, index = layout.role_of(rank)
    blocked = ({s.location.group for s in state.values() if s.syncing} if role == ROLLOUT
               else set() if role == TOOLS else {index})     # a tool rank holds no trainer
    return [agent for agent, s in state.items()
            if s.leader != rank and s.location.group not in blocked and not moving[s.location.group]]


@dataclass(frozen=True)
class Stops:
    """What a failure may ask of the orchestrator."""
    drain: Callable[[], None]
    """Wait for the commands out to be answered (a clean stop)."""
    checkpoint: Callable[..., None]
    """checkpoint(agents, only=False): checkpoint these agents (`only`: no other command waits)."""
    stop_workers: Callable[[int], None]
    """Send every worker the Stop and close the store with this exit code."""
    flush: Callable[[], None]
    """Write the steps' rows so far (no checkpoint) and flush the store, before an abort."""


class FailureHandler:
    """`receive` (the waits that find failures) and what each failure does (module docstring)."""

    def __init__(self, cfg: Config, layout: RankLayout, transport, deadlines, store, exp, state: dict,
                 moving: dict[int, int], stops: Stops, preempted: Callable[[], bool], log) -> None:
        self.cfg, self.layout, self.transport, self.deadlines, self.store = cfg, layout, transport, deadlines, store
        self.exp, self.state, self.moving, self.stops = exp, state, moving, stops
        self.preempted, self.log = preempted, log
        self.aborting = False                    # a hung or dead worker: the job is ending
        self.stalled = False                     # receive(loop=True): nothing can come

    def episodes_failing(self) -> bool:
        """Log what the episodes' failures have to say (episode_failures.py); True once more
        than workflow.max_failure_rate of a step's episodes failed."""
        failures = self.exp.failures
        if failures is None:
            return False
        for line in failures.take_lines():
            self.log(line)
        return failures.stop is not None

    def stop_preempted(self) -> int:
        self.log("preemption signal: draining, checkpointing every agent, flushing the store")
        self.stops.drain()
        self.stops.checkpoint(list(self.state))
        self.stops.stop_workers(EXIT_REQUEUE)
        return EXIT_REQUEUE

    def stop_failing(self) -> int:
        """Too many episodes failed: one line saying so, with the first traceback, then stop
        as on preemption (drain, checkpoint, flush) but exit EXIT_EPISODES, not a requeue:
        the same episodes would fail again."""
        self.log(f"{self.exp.failures.stop}\nexiting {EXIT_EPISODES} (checkpointed, store flushed; "
                 "fix the episode function, then the same command resumes)")
        self.stops.drain()
        self.stops.checkpoint(list(self.state))
        self.stops.stop_workers(EXIT_EPISODES)
        return EXIT_EPISODES

    def receive(self, wake: bool = False, loop: bool = False) -> tuple[int, messages.Reply] | None:
        """The next reply as (source rank, message), waiting without a spin; a rank that
        leaves its command unanswered for run.worker_timeout seconds, or whose process ends
        (runtime/liveness.py), ends the job with the requeue code. `wake`: episodes wait on
        tools: return None after EPISODE_POLL_S if nothing came, so they can go on. `loop`
        (the main loop): also None within SIGNAL_CHECK_S of a preemption signal, and after
        STALL_S with no command outstanding (`self.stalled` set)."""
        idle = None
        while True:
            timeout = self.deadlines.next_deadline()
            if timeout is None:
                idle = self.store.now() if idle is None else idle
            slice_s = SIGNAL_CHECK_S if timeout is None else min(timeout, SIGNAL_CHECK_S)
            if wake:
                slice_s = min(slice_s, EPISODE_POLL_S)
            try:
                return self.transport.receive(slice_s)
            except WorkerLost as e:
                self.stop_lost(e.rank)
            except TimeoutError:
                late = self.deadlines.overdue()
                if late is not None:
                    self.stop_hung(*late)
                if wake or (loop and self.preempted()):
                    return None
                if loop and idle is not None and timeout is None and self.store.now() - idle > STALL_S:
                    self.stalled = True
                    return None

    def stop_stalled(self) -> int:
        """Nothing outstanding on any rank and nothing the scheduler can hand out: no reply
        will come. Say what each agent waits for, checkpoint, flush and exit EXIT_STALLED
        (not a requeue: the same state would stall again)."""
        waits = "; ".join(f"{a} at version {s.version}: {self.exp.ready_count(a, s.version)} ready, "
                          f"{len(self.exp.pending[a])} to generate, batch {self.exp.batch_of(a, s.version)}"
                          for a, s in self.state.items())
        self.log(f"stalled: no command outstanding on any rank and none to send ({waits}); "
                 f"checkpointing, flushing the store, exiting {EXIT_STALLED}")
        self.stops.drain()
        self.stops.checkpoint(list(self.state))
        self.stops.stop_workers(EXIT_STALLED)
        return EXIT_STALLED

    def stop_hung(self, rank: int, what: str, secs: float) -> None:
        """A worker left a command unanswered for run.worker_timeout: say who and what,
        then `requeue_without`."""
        self.log(f"{who(self.layout, rank)} (rank {rank}): no answer to {what} for {secs:.0f} s "
                 f"(run.worker_timeout={self.cfg.run.worker_timeout:g})")
        self.requeue_without(rank)

    def stop_lost(self, rank: int) -> None:
        """A worker's process has ended (its liveness socket closed: killed, out of memory,
        its node gone) without being stopped: the same as a hung worker, seconds after."""
        running = self.deadlines.running(rank)
        self.log(f"{who(self.layout, rank)} (rank {rank}): its process has ended (liveness socket closed)"
                 + (f" during {running}" if running else ""))
        self.requeue_without(rank)

    def sync_timed_out(self, rank: int, msg: messages.SyncTimedOut) -> None:
        """A member of a weight sync gave up on it at its deadline: a hung collective. The
        reporter is out of it and answers again, so a leader's agent can be checkpointed
        still; another member is the suspect (it never arrived, or stalled the transfer),
        and the job ends as for a hung worker. The other members' reports of the same sync,
        arriving meanwhile, add their line only."""
        self.log(f"{who(self.layout, rank)} (rank {rank}): gave up on the weight sync of agent "
                 f"{msg.agent} v{msg.version} over ranks {list(msg.members)}: {msg.reason}")
        if self.aborting:
            return
        st = self.state[msg.agent]
        if rank == st.leader:
            st.syncing = False                     # the sender is free: checkpointable
        suspects = [m for m in msg.members if m not in (rank, st.leader)] or [m for m in msg.members if m != rank]
        self.requeue_without(suspects[0])

    def requeue_without(self, rank: int) -> None:
        """Checkpoint the agents whose trainer groups still answer, flush the store, and end
        the whole job with the requeue code (a hung or dead rank cannot be stopped by a
        message). A second failure meanwhile ends the job at once."""
        if not self.aborting:
            self.aborting = True
            requeue.mark(f"{who(self.layout, rank)} (rank {rank}) was lost or hung")
            self.deadlines.forget(rank)
            alive = checkpointable(self.state, self.moving, self.layout, rank)
            self.log(f"checkpointing {', '.join(alive) or 'no agent'}, flushing the store, "
                     f"exiting {EXIT_REQUEUE} to requeue")
            if alive:
                self.stops.checkpoint(alive, only=True)
        self.abort(EXIT_REQUEUE)

    def reward_hung(self, what: str, secs: float) -> None:
        """The watchdog thread: rank 0 itself is stuck in a reward function. The main thread
        cannot checkpoint, so flush what the store has and end the job for a requeue."""
        self.log(f"reward function (orchestrator, rank 0): no return from {what} for {secs:.0f} s "
                 f"(run.worker_timeout={self.cfg.run.worker_timeout:g}); flushing the store, "
                 f"exiting {EXIT_REQUEUE} to requeue")
        requeue.mark(f"a reward function hung on the orchestrator ({what})")
        self.abort(EXIT_REQUEUE)

    def abort(self, code: int) -> None:
        try:
            self.stops.flush()
        finally:
            self.transport.abort(code)
