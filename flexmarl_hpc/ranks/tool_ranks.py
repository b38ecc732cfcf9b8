"""Tool calls and reward functions on tool ranks of their own (tools.ranks > 0): the last
het component of the job (slurm.tools), like RollArt's environment cluster.

    pool = RemotePool(world, layout.tool_rank_list, cfg.tools)   # rank 0, WorkerPool's interface
    call = await pool.tool("python", "print(1)")                  # ToolCall: output, outcome, latency
    done = await pool.call(my_reward, text, answer, timeout_s=5)  # Called: value, outcome, latency
    tools_loop(world, 0, WorkerPool(Tools.from_config(cfg.tools), cfg.tools), live)   # a tool rank

Rank 0 sends typed commands (messages.ToolRequest, CallRequest) on TAG_CMD of the world it
is given and reads the answers (ToolDone, CallDone) on TAG_TOOL, apart from the replies its
transport reads, so the orchestrator's loop never sees them. Each tool rank runs its own
WorkerPool: the sandbox's limits and a reward's timeout are enforced where the call runs,
and a crash there is that call's outcome. Rank 0 sends a rank at most tools.workers calls
at a time (the least loaded first, so none waits in a queue on the rank) and gives up on a
call GRACE_S past its own limit: a stalled rank's calls end as `timeout`, never a hung
episode. A tool rank whose process ends is a dead worker (runtime/liveness.py: the job
checkpoints and exits 75); at the end it answers the orchestrator's Stop like any worker.

Every wait polls with Iprobe and sleeps with back-off (MIN_SLEEP .. MAX_SLEEP) on an asyncio
loop: rank 0's is the episode runner's, which the orchestrator steps every 20 ms while an
episode waits on a tool (workflows/episode.py); a tool rank's is its own.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import pickle
import queue
import time
from concurrent.futures import CancelledError as FutureCancelled, Future, TimeoutError as FutureTimeout
from typing import Callable

from flexmarl_hpc import faults
from flexmarl_hpc.runtime import messages
from flexmarl_hpc.runtime.comm import TAG_CMD, TAG_TOOL, poll, waitall
from flexmarl_hpc.runtime.liveness import peer_ended
from flexmarl_hpc.runtime.transport import send_reply
from flexmarl_hpc.config.tools import ToolsConfig
from flexmarl_hpc.tools.pool import Called, WorkerPool
from flexmarl_hpc.tools.registry import ToolCall
from flexmarl_hpc.workflows.openai_agent import RelayedURL, serve_http

GRACE_S = 10.0
"""Seconds past a call's own limit (tools.wall_s, or its timeout_s) before rank 0 gives it
up: the sandbox's kill ends a call about 3 s past wall_s, plus a worker's start and the
round trip."""
MIN_SLEEP, MAX_SLEEP = 5e-4, 0.02


async def _backoff(delay: float) -> float:
    await asyncio.sleep(delay)
    return min(2 * delay, MAX_SLEEP)


class RemotePool:
    """Rank 0's end: WorkerPool's `tool`, `call` and `close`, served by the tool ranks."""

    relays_endpoints = True
    """workflow.agent programs run on the tool ranks and reach their episode's OpenAI
    endpoint through their rank's Relay (workflows/openai_agent.py reads this)."""

    def __init__(self, comm, ranks: list[int], cfg: ToolsConfig, grace_s: float = GRACE_S, live=None):
        if not ranks:
            raise ValueError("RemotePool: no tool ranks")
        self.comm, self.ranks, self.cfg, self.grace_s = comm, list(ranks), cfg, grace_s
        self.live = live
        """runtime/liveness.Liveness or None: a tool rank that has ended gets no call, and its
        sends are never tested again (either can hang in MPI; the orchestrator ends the job)."""
        self.outstanding = dict.fromkeys(self.ranks, 0)
        """Calls sent to each rank and not answered yet (given-up ones included)."""
        self.served = dict.fromkeys(self.ranks, 0)
        """Answers received from each rank."""
        self.given_up: dict[int, int] = {}
        """call id -> rank of the calls past their deadline (a late answer is dropped)."""
        self.pending: dict[int, asyncio.Future] = {}
        self.sending: list = []
        """(rank, request) of each send not known complete."""
        self.next_id = 0
        self._free: asyncio.Semaphore | None = None      # made on the loop that first waits
        self._receiver: asyncio.Task | None = None
        self.endpoint: Callable | None = None
        """The OpenAI endpoint's `answer_here(method, token, tail, body)` -> (status, JSON),
        set by its server: relayed requests of the programs on the tool ranks go there."""
        self.relaying: set[asyncio.Task] = set()

    async def tool(self, name: str, argument: str, lent: bool = False) -> ToolCall:
        """WorkerPool.tool on a tool rank; lent: in the slot its caller holds (no slot taken
        here or there)."""
        t0 = time.perf_counter()
        done, rank = await self._ask(lambda i: messages.ToolRequest(i, name, argument, lent), self.cfg.wall_s,
                                     lent=lent)
        if done is None:
            return ToolCall(name, f"error: tool rank {rank} gave no answer in "
                                  f"{self.cfg.wall_s + self.grace_s:g} s", "timeout", time.perf_counter() - t0)
        return ToolCall(name, done.output, done.outcome, done.latency_s)

    async def call(self, fn: Callable, *args, timeout_s: float | None = None) -> Called:
        """fn(*args) on a tool rank; fn must pickle by name (a module-level function)."""
        timeout_s = self.cfg.wall_s if timeout_s is None else timeout_s
        t0 = time.perf_counter()
        try:
            payload = pickle.dumps((fn, args))
        except Exception as e:                     # noqa: BLE001 - a lambda, a closure, a lock
            return Called(None, "error", 0.0, f"cannot send {fn!r} to a tool rank: {type(e).__name__}: {e}")
        done, rank = await self._ask(lambda i: messages.CallRequest(i, payload, float(timeout_s)), timeout_s)
        if done is None:
            return Called(None, "timeout", time.perf_counter() - t0,
                          f"tool rank {rank} gave no answer in {timeout_s + self.grace_s:g} s")
        return Called(done.value, done.outcome, done.latency_s, done.error)

    async def _ask(self, make: Callable[[int], messages.Command], limit_s: float, lent: bool = False):
        """Send make(call_id) to the least loaded rank; (its answer or None past the
        deadline, the rank). lent: the caller's slot is the call's (no slot taken)."""
        if self._free is None:
            self._free = asyncio.Semaphore(len(self.ranks) * self.cfg.workers)
        async with (contextlib.nullcontext() if lent else self._free):
            alive = [r for r in self.ranks if not self._dead(r)]
            if not alive:
                return None, self.ranks[0]                # the job ends for the dead rank
            rank = min(alive, key=lambda r: (self.outstanding[r], r))
            call_id, self.next_id = self.next_id, self.next_id + 1
            future = asyncio.get_running_loop().create_future()
            self.sending.append((rank, self.comm.isend(messages.encode(make(call_id)), dest=rank, tag=TAG_CMD)))
            self.pending[call_id] = future
            self.outstanding[rank] += 1
            if self._receiver is None or self._receiver.done():
                self._receiver = asyncio.ensure_future(self._receive())
            try:
                return await asyncio.wait_for(future, limit_s + self.grace_s), rank
            except asyncio.TimeoutError:
                self.given_up[call_id] = rank             # still counted against the rank
                return None, rank
            finally:
                self.pending.pop(call_id, None)

    async def _receive(self) -> None:
        """Resolve the pending calls' futures as their answers come (one task, while any
        call is pending; an answer to a given-up call only frees its rank's count)."""
        delay = MIN_SLEEP
        while self.pending:
            self.sending = [(r, q) for r, q in self.sending if not self._dead(r) and not q.Test()]
            got = poll(self.comm, tag=TAG_TOOL)
            if got is None:
                delay = await _backoff(delay)
                continue
            delay = MIN_SLEEP
            msg, src = messages.decode(got[0]), got[1]
            if isinstance(msg, messages.EndpointRequest):      # a program's request, not an answer
                task = asyncio.ensure_future(self._relay(msg, src))
                self.relaying.add(task)
                task.add_done_callback(self.relaying.discard)
                continue
            self.outstanding[src] -= 1
            self.served[src] += 1
            self.given_up.pop(msg.call_id, None)
            future = self.pending.get(msg.call_id)
            if future is not None and not future.done():
                future.set_result(msg)

    async def _relay(self, req: messages.EndpointRequest, src: int) -> None:
        """Answer a program's request that tool rank `src` relayed, on the endpoint here."""
        if self.endpoint is None:
            status, reply = 503, {"error": {"message": "no OpenAI endpoint runs on the orchestrator",
                                            "type": "server_error", "param": None, "code": "unavailable"}}
        else:
            status, reply = await self.endpoint(req.method, req.token, req.tail, req.body)
        self.sending.append((src, self.comm.isend(messages.encode(messages.EndpointReply(req.relay_id, status, reply)),
                                                  dest=src, tag=TAG_CMD)))

    def _dead(self, rank: int) -> bool:
        return peer_ended(self.live, rank)

    def close(self) -> None:
        """Nothing to end here: the tool ranks stop at the orchestrator's Stop."""
        if self._receiver is not None:
            self._receiver.cancel()
        for task in self.relaying:
            task.cancel()


# ---------------------------------------------------------------------------------------
# a tool rank's relay for the OpenAI endpoint
# ---------------------------------------------------------------------------------------
class Relay:
    """A tool rank's loopback HTTP server for the workflow.agent programs it runs: each
    request goes to the orchestrator over MPI (EndpointRequest on TAG_TOOL), whose episode
    endpoint answers it (EndpointReply on TAG_CMD). The orchestrator listens on its own
    node's loopback, which a program on another node cannot reach; MPI reaches every rank.

    Server threads only queue their requests and wait: MPI is called from the rank's loop
    (`pump`, `deliver`), never from them (MPI may not be initialised for threads)."""

    WAIT_S = 86400.0
    """Most seconds a request waits (workflow.agent_timeout_s's bound: the program is
    killed at its own timeout well before)."""

    def __init__(self):
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.waiting: dict[int, Future] = {}
        self.ids = itertools.count()
        self.httpd = None

    def url(self, relayed) -> str:
        """The URL of an episode's route (openai_agent.RelayedURL) on this relay, started on
        the first program."""
        if self.httpd is None:
            self.httpd, _ = serve_http(self)
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{relayed.path}"

    def answer(self, method: str, token: str, tail: str, body: bytes) -> tuple[int, dict]:
        """(status, JSON) of a program's request, from a server thread."""
        rid, fut = next(self.ids), Future()
        self.waiting[rid] = fut
        self.outbox.put(messages.EndpointRequest(rid, method, token, tail, body))
        try:
            return fut.result(self.WAIT_S)
        except (FutureTimeout, FutureCancelled):
            return 503, {"error": {"message": "the orchestrator gave no answer (the run ends)", "type": "server_error",
                                   "param": None, "code": "unavailable"}}
        finally:
            self.waiting.pop(rid, None)

    def pump(self, world, orch: int, sending: list) -> bool:
        """Send the queued requests to the orchestrator; whether there were any."""
        sent = False
        while not self.outbox.empty():
            sending.append(world.isend(messages.encode(self.outbox.get()), dest=orch, tag=TAG_TOOL))
            sent = True
        return sent

    def deliver(self, reply: messages.EndpointReply) -> None:
        fut = self.waiting.get(reply.relay_id)
        if fut is not None and not fut.done():
            fut.set_result((reply.status, reply.reply))

    def close(self) -> None:
        for fut in list(self.waiting.values()):
            fut.cancel()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()


# ---------------------------------------------------------------------------------------
# a tool rank
# ---------------------------------------------------------------------------------------
def tools_loop(world, orch: int, pool: WorkerPool, live=None) -> int:
    """A tool rank: run each command of `orch` on `pool` as it comes (up to tools.workers
    at once), answer it on TAG_TOOL; at Stop end the pool, answer Stopped and return its
    code. `live`: disarmed at the Stop, so the orchestrator's end that follows is no loss."""
    return asyncio.run(_serve(world, orch, pool, live))


async def _serve(world, orch: int, pool: WorkerPool, live) -> int:
    running: set[asyncio.Task] = set()
    sending: list = []
    relay = Relay()
    delay = MIN_SLEEP
    while True:
        sending[:] = [r for r in sending if not r.Test()]
        if relay.pump(world, orch, sending):
            delay = MIN_SLEEP
        got = poll(world, source=orch, tag=TAG_CMD)
        if got is None:
            delay = await _backoff(delay)
            continue
        delay = MIN_SLEEP
        cmd = messages.decode(got[0])
        if isinstance(cmd, messages.EndpointReply):
            relay.deliver(cmd)
            continue
        if isinstance(cmd, messages.Stop):
            for t in running:
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            relay.close()
            pool.close()
            if live is not None:
                live.disarm()
            waitall(sending)
            send_reply(world, orch, messages.Stopped(-1))
            return cmd.code
        task = asyncio.ensure_future(_answer(world, orch, pool, cmd, sending, relay))
        running.add(task)
        task.add_done_callback(running.discard)


async def _answer(world, orch: int, pool: WorkerPool, cmd: messages.Command, sending: list,
                  relay: Relay | None = None) -> None:
    """Run one command and answer it, whatever happens: a call left unanswered would cost
    its episode GRACE_S of waiting. `relay`: where a program's RelayedURL points."""
    faults.hit("tool_call")                         # test-only: a tool rank killed or stalled here
    t0 = time.perf_counter()
    try:
        if isinstance(cmd, messages.ToolRequest):
            r = await pool.tool(cmd.tool, cmd.argument, lent=cmd.lent)
            reply = messages.ToolDone(cmd.call_id, r.output, r.outcome, r.latency_s)
        elif isinstance(cmd, messages.CallRequest):
            reply = await _run_call(pool, cmd, relay)
        else:
            raise ValueError(f"tool rank: unknown command {cmd.kind!r}")
    except Exception as e:                         # noqa: BLE001 - e.g. a worker that could not start
        why, took = f"{type(e).__name__}: {e}", time.perf_counter() - t0
        reply = (messages.ToolDone(cmd.call_id, f"error: {why}", "crashed", took)
                 if isinstance(cmd, messages.ToolRequest) else
                 messages.CallDone(getattr(cmd, "call_id", -1), None, "crashed", took, why))
    try:
        sending.append(world.isend(messages.encode(reply), dest=orch, tag=TAG_TOOL))
    except Exception as e:                         # noqa: BLE001 - a return value that does not pickle
        reply = messages.CallDone(cmd.call_id, None, "error", reply.latency_s,
                                  f"the return value cannot be sent back: {type(e).__name__}: {e}")
        sending.append(world.isend(messages.encode(reply), dest=orch, tag=TAG_TOOL))


async def _run_call(pool: WorkerPool, cmd: messages.CallRequest, relay: Relay | None = None) -> messages.CallDone:
    try:
        fn, args = pickle.loads(cmd.payload)
    except Exception as e:                         # noqa: BLE001 - its module does not import here
        return messages.CallDone(cmd.call_id, None, "error", 0.0,
                                 f"cannot load the function on the tool rank: {type(e).__name__}: {e}")
    if relay is not None:                          # a workflow.agent program: its endpoint, through here
        args = tuple(relay.url(a) if isinstance(a, RelayedURL) else a for a in args)
    c = await pool.call(fn, *args, timeout_s=cmd.timeout_s)
    return messages.CallDone(cmd.call_id, c.value, c.outcome, c.latency_s, c.error)
