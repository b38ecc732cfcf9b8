"""Every message between the orchestrator and its workers, one frozen dataclass per kind.

Commands go from the orchestrator (world rank 0) to a replica or a trainer group's
leader; replies come back. Every reply carries the busy intervals the worker spent since
its last reply, so the store can account for every rank's time.

On the wire (`encode`/`decode`, next to each other at the end) a message is a plain tuple
`(kind, field, ...)`: what mpi4py's lowercase send pickles cheaply. Numpy arrays stay
arrays and nothing is copied; the classes themselves never travel, so a worker and the
orchestrator agree on a message by its `kind` and field order alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:                   # no torch/MPI import for a module of plain data
    from flexmarl_hpc.learn.sampling import SamplingParams



@dataclass(frozen=True)
class Location:
    """Where an agent's training state is (`Move`'s ends; runtime/state_swap.py moves it).
    Here, not in state_swap, which imports torch and MPI: the orchestrator and the simulator
    use it without either."""
    group: int
    """Trainer group whose ranks hold the state."""
    resident: bool
    """True: live on the group's device as a trainer; False: parked in the group's host memory."""


class WorkerLost(Exception):
    """A transport's `receive`: worker `rank` has ended (its liveness socket closed) without
    stopping. Here, not in runtime/transport.py (MPI), so the orchestrator can catch it
    without importing MPI."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"rank {rank} has ended")
        self.rank = rank


Interval = tuple[str, str, float, float]
"""(activity, agent, t0, t1): seconds since the epoch on the run's clock (WorkerClock's) a worker spent on one thing;
"wait" for gaps."""

Request = tuple
"""One generation request: (sample_id, prompt tokens, seed, max_new_tokens, turn[, sampling]),
the fields of rollout.base.GenRequest in order; `sampling`, (temperature, top_p) of this
request alone, only where an episode call set its own."""


class Message:
    kind: ClassVar[str]
    """The tag of this message kind on the wire."""


# -- commands: orchestrator -> worker ---------------------------------------------------------
class Command(Message):
    pass


@dataclass(frozen=True)
class Generate(Command):
    """Sample a batch of requests with `agent`'s weights (replica)."""
    kind: ClassVar[str] = "generate"
    batch_id: int
    """The orchestrator's number for the batch; the `Generated` reply names it."""
    agent: str
    version: int
    """The policy version the replica must hold for `agent` (it refuses otherwise)."""
    requests: list[Request]
    params: SamplingParams | None = None
    """Sampling parameters of this batch (an evaluation's greedy ones); None: the run's."""


@dataclass(frozen=True)
class Sync(Command):
    """Join the broadcast of `agent`'s weights at `version` (a trainer leader sends, the
    replicas in `members` receive)."""
    kind: ClassVar[str] = "sync"
    agent: str
    version: int
    members: tuple[int, ...]
    """World ranks of the broadcast: the trainer group's leader first, then the replicas."""


@dataclass(frozen=True)
class Train(Command):
    """Forward and backward one micro-batch of `agent`'s step (trainer group)."""
    kind: ClassVar[str] = "train"
    agent: str
    step: int
    arrays: dict[str, Any]
    """The padded micro-batch (numpy arrays, see microbatch.pack_microbatch)."""
    scale: float
    """Loss scale of each sample: 1 / the step's batch size."""
    last: bool
    """The step's last micro-batch: take the optimizer step after it."""


@dataclass(frozen=True)
class Move(Command):
    """Move `agent`'s training state from `src` to `dst` (both groups' leaders get it)."""
    kind: ClassVar[str] = "move"
    agent: str
    src: Location
    dst: Location


@dataclass(frozen=True)
class Checkpoint(Command):
    """Write a checkpoint of each of these agents (all on the receiving group)."""
    kind: ClassVar[str] = "checkpoint"
    agents: list[str]


@dataclass(frozen=True)
class Stop(Command):
    """Finish: release the sync channels, answer `Stopped`, and exit with `code`."""
    kind: ClassVar[str] = "stop"
    code: int


@dataclass(frozen=True)
class ToolRequest(Command):
    """Run a bundled tool (tool rank, ranks/tool_ranks.py); answered by `ToolDone` on TAG_TOOL."""
    kind: ClassVar[str] = "tool"
    call_id: int
    tool: str
    argument: str
    lent: bool = False
    """The caller holds a worker slot for it (a workflow.agent program's call): none is taken."""


@dataclass(frozen=True)
class CallRequest(Command):
    """`fn(*args)` in a worker process of a tool rank; answered by `CallDone` on TAG_TOOL."""
    kind: ClassVar[str] = "call"
    call_id: int
    payload: bytes
    """pickle of (fn, args): fn travels by name (a module-level function whose module must
    import on the tool rank), loaded there inside a try, so one that does not is that
    call's error, not the rank's end."""
    timeout_s: float


@dataclass(frozen=True)
class EndpointReply(Command):
    """The orchestrator's answer to a relayed `EndpointRequest`: the HTTP status and JSON
    the tool rank's relay sends back to the program (on TAG_CMD)."""
    kind: ClassVar[str] = "endpoint_reply"
    relay_id: int
    status: int
    reply: dict


# -- replies: worker -> orchestrator ----------------------------------------------------------
@dataclass(frozen=True)
class Reply(Message):
    intervals: list[Interval] = field(default=(), kw_only=True)
    """The worker's busy intervals since its last reply."""


@dataclass(frozen=True)
class Generated(Reply):
    """The outputs of a `Generate` batch, in request order."""
    kind: ClassVar[str] = "generated"
    batch_id: int
    outputs: list[tuple[list[int], list[float]]]
    """(response tokens, their behaviour log-probs) per request."""


@dataclass(frozen=True)
class Synced(Reply):
    """A replica now holds `agent` at `version`."""
    kind: ClassVar[str] = "synced"
    replica: int
    """The replica's index (world rank - 1)."""
    agent: str
    version: int
    dropped: tuple[str, ...] = ()
    """Agents the replica no longer holds: their engine was switched to `agent` by this
    load (vLLM engines shared by agents of one architecture keep no host copies)."""


@dataclass(frozen=True)
class TrainerSynced(Reply):
    """The trainer group's leader has sent `agent`'s weights at `version`."""
    kind: ClassVar[str] = "tsynced"
    agent: str
    version: int


@dataclass(frozen=True)
class SyncTimedOut(Reply):
    """A member (the leader or a replica) gave up on the weight sync of `agent` at `version`
    at its deadline (weight_sync.timeout_s, runtime/deadline.py): another member never
    arrived, or the transfer stalled. The member is out of the collective and answers again."""
    kind: ClassVar[str] = "synctimeout"
    agent: str
    version: int
    members: tuple[int, ...]
    reason: str
    """What was not done in time, and after how long (CollectiveTimeout's message)."""


@dataclass(frozen=True)
class Trained(Reply):
    """A micro-batch that was not its step's last has been through forward and backward."""
    kind: ClassVar[str] = "trained"
    agent: str
    step: int


@dataclass(frozen=True)
class Stepped(Reply):
    """The step's last micro-batch and the optimizer step are done: `agent` is now at
    `version`."""
    kind: ClassVar[str] = "stepped"
    agent: str
    version: int
    stats: dict[str, float]
    """Trainer statistics summed over the step's samples and the group (grad_norm: once)."""


@dataclass(frozen=True)
class Checkpointed(Reply):
    kind: ClassVar[str] = "checkpointed"
    agents: list[str]


@dataclass(frozen=True)
class Moved(Reply):
    """One side (source or destination group) of a `Move` is done."""
    kind: ClassVar[str] = "moved"
    agent: str


@dataclass(frozen=True)
class Stopped(Reply):
    """A worker rank's last message (every rank of a trainer group sends one)."""
    kind: ClassVar[str] = "stopped"
    replica: int
    """The replica's index; -1 from a trainer rank."""


@dataclass(frozen=True)
class Intervals(Reply):
    """A trainer group member's intervals after each command (only the leader answers
    the command itself)."""
    kind: ClassVar[str] = "intervals"


@dataclass(frozen=True)
class ToolDone(Reply):
    """A tool rank's answer to a `ToolRequest` (tools.registry.ToolCall's fields, without the
    sandbox record)."""
    kind: ClassVar[str] = "tool_done"
    call_id: int
    output: str
    outcome: str
    latency_s: float


@dataclass(frozen=True)
class CallDone(Reply):
    """A tool rank's answer to a `CallRequest` (tools.pool.Called's fields)."""
    kind: ClassVar[str] = "call_done"
    call_id: int
    value: Any
    outcome: str
    latency_s: float
    error: str


@dataclass(frozen=True)
class EndpointRequest(Reply):
    """An HTTP request a workflow.agent program on a tool rank sent its rank's relay, for
    the episode's OpenAI endpoint on the orchestrator (workflows/openai_agent.py; on
    TAG_TOOL, answered by `EndpointReply`): the orchestrator's node may be another."""
    kind: ClassVar[str] = "endpoint"
    relay_id: int
    method: str
    token: str
    """The episode's route (/ep/<token>/...)."""
    tail: str
    """The path after the route, e.g. 'v1/chat/completions'."""
    body: bytes


COMMANDS = (Generate, Sync, Train, Move, Checkpoint, Stop, ToolRequest, CallRequest, EndpointReply)
REPLIES = (Generated, Synced, TrainerSynced, SyncTimedOut, Trained, Stepped, Checkpointed, Moved, Stopped, Intervals,
           ToolDone, CallDone, EndpointRequest)


# -- the wire ---------------------------------------------------------------------------------
_NAMES = {c: tuple(f.name for f in fields(c)) for c in COMMANDS + REPLIES}
_BY_KIND = {c.kind: c for c in COMMANDS + REPLIES}


def encode(msg: Message) -> tuple:
    """(kind, field values in declaration order): no copies, arrays stay arrays."""
    return (msg.kind, *(getattr(msg, n) for n in _NAMES[type(msg)]))


def decode(wire: tuple) -> Message:
    cls = _BY_KIND.get(wire[0]) if isinstance(wire, tuple) and wire else None
    if cls is None or len(wire) != 1 + len(_NAMES[cls]):
        raise ValueError(f"not a message: {str(wire)[:200]}")
    return cls(**dict(zip(_NAMES[cls], wire[1:])))
