"""Episode functions: a multi-agent workflow written as Python over chat messages.

    async def episode(ctx, example):
        plan = await ctx.chat("planner", [{"role": "user", "content": example["question"]}])
        answers = await asyncio.gather(*(ctx.chat("solver", [...]) for _ in range(k)))
        check = await ctx.tool("calculator", "3 * (4 + 5)")
        return {"planner": 1.0, "solver": [1.0, 0.0], "verifier": 0.5}

referenced from YAML as `workflow.episode: my_pkg.my_module:episode` (docs/episodes.md).
`ctx.chat` returns a `Reply` (the sampled text and its token ids); the call is one training
sample of that agent: its prompt is the agent's own conversation so far, token for token
(workflows/chat.py: earlier responses are never re-tokenised), its response the sampled
tokens. The return value gives each agent a reward: one float for all its calls, or a list
with one per call. An episode that raises is failed: its error (type, message, traceback) is
kept for the store's /failures and the log, and its calls are dropped from training or given
reward 0 (`workflow.on_error`, orchestrator/episodes.py).
`ctx.settle(agent, reward)` gives an agent its reward mid-episode (its rule reward is known
from its own replies): that agent is done in this episode (no more calls), and its calls can
be trained once every episode of the example has settled it, while later agents still run;
a settled agent needs no reward in the return value, and keeps its own if the episode raises.

Episodes run as coroutines on an asyncio loop that the host steps (`EpisodeRunner.step`):
the orchestrator in a run, the evaluator offline. No threads: the order in which calls
appear is a function of the order their replies arrived, so a replay on resume (the same
replies, taken from the store) makes the same calls. Episode functions must therefore be
deterministic given their replies and tool outputs: draw randomness from `ctx.rng`.
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import traceback
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import numpy as np

from flexmarl_hpc.workflows.toolcalls import ToolCallError, ToolRequest, parser_for, tool_message


class ContextFull(ValueError):
    """A conversation outgrew its agent's context; the episode fails (its calls: reward 0)."""


@dataclass(frozen=True)
class Reply:
    """What `ctx.chat` returns."""
    text: str
    """The response as text (special tokens and the stop token dropped), after the call's
    `prefill` when it had one."""
    ids: tuple[int, ...]
    """The sampled token ids, stop token included: what the trainer sees."""
    call: int
    """This agent's call index in the episode (0 for its first call)."""
    truncated: bool
    """It hit max_tokens without a stop token."""
    prompt_len: int = 0
    """Tokens of the call's prompt (the OpenAI endpoint's usage)."""
    tool_calls: tuple[ToolRequest, ...] = ()
    """The tool calls in the reply (a call made with `tools=`), parsed in the agent's
    model.tool_format; run them with `ctx.run_tools(reply)`."""
    tool_errors: tuple[ToolCallError, ...] = ()
    """Tool-call blocks that could not be read (bad JSON, no name): reported, not raised."""
    retokenized: bool = False
    """The prompt was tokenised fresh from a history (`Call.retokenized`)."""

    @property
    def message(self) -> dict:
        """The reply as the assistant message that continues its conversation token for token
        (its text as sampled, tool-call blocks included)."""
        return {"role": "assistant", "content": self.text}


@dataclass(eq=False)
class Thread:
    """One conversation of an agent in an episode: the messages it has seen, with its
    replies, and their token ids (workflows/chat.py Conversation). A call whose messages
    extend an idle thread's continues it; any other call starts a new thread (parallel
    calls of one agent, e.g. three solvers, are three threads)."""
    conv: Any
    messages: list = field(default_factory=list)
    busy: bool = False

    def continued_by(self, messages: list[dict]) -> bool:
        n = len(self.messages)
        return not self.busy and n > 0 and len(messages) > n and list(messages[:n]) == self.messages


def retokenizes(messages: list[dict], continued: bool) -> bool:
    """A call's messages hold an assistant message yet continue none of the agent's
    conversations (the history was edited or cut, or is not one the agent answered): the
    prompt is tokenised fresh from that text, not from the ids the policy sampled."""
    return not continued and any(m.get("role") == "assistant" for m in messages)


@dataclass(eq=False)
class Call:
    """One `ctx.chat` in flight: the host generates `prompt` and calls `done`."""
    episode: "EpisodeContext"
    agent: str
    index: int
    """The agent's call index in its episode."""
    prompt: list[int]
    max_tokens: int
    parent: "Call | None"
    """The call of the episode that completed last before this one was made."""
    thread: Thread = field(repr=False, default=None)
    messages: list = field(repr=False, default_factory=list)
    future: asyncio.Future = field(repr=False, default=None)
    sampling: tuple[float, float] | None = None
    """(temperature, top_p) this call asked for; None: the run's (rollout.temperature, top_p)."""
    tools: list | None = None
    """The tool schemas the prompt was rendered with; their calls are parsed from the reply."""
    prefill: str = ""
    """Text the reply was made to start with: the end of `prompt` (not sampled, not trained);
    the reply's text begins with it, so its message continues these ids."""
    prefill_len: int = 0
    """How many of `prompt`'s last ids are the prefill's (its /samples row's prefill_len)."""
    retokenized: bool = False
    """The prompt was tokenised fresh from a history, not from the sampled ids (its row's
    retokenized): `retokenizes`, or its conversation's rendering no longer extended the ids."""

    def done(self, response: list[int], stop_ids: frozenset[int]) -> None:
        text = self.prefill + self.thread.conv.record(list(response))
        self.thread.messages = list(self.messages) + [{"role": "assistant", "content": text}]
        self.thread.busy = False
        self.episode.last_done = self
        truncated = not response or response[-1] not in stop_ids
        calls, errors = [], []
        if self.tools:
            parse = parser_for(self.episode.runner.tool_formats.get(self.agent, "hermes"))
            calls, errors = parse(text, f"{self.agent}-{self.index}")
        self.future.set_result(Reply(text, tuple(response), self.index, truncated, prompt_len=len(self.prompt),
                                     tool_calls=tuple(calls), tool_errors=tuple(errors),
                                     retokenized=self.retokenized))


class EpisodeContext:
    """The `ctx` of one episode: chat with agents, call tools, draw random numbers."""

    def __init__(self, runner: "EpisodeRunner", step: int, example_id: int, episode: int, args: dict):
        self.runner, self.step, self.example_id, self.episode = runner, step, example_id, episode
        self.args = args
        """workflow.episode_args, as the YAML gives them."""
        self.rng = np.random.default_rng([runner.seed, example_id, episode])
        """This episode's random numbers (seeded by run seed, example and episode index)."""
        self.metrics: dict[str, float] = {}
        """What an evaluation averages over episodes (scripts/eval_heldout.py), e.g. accuracy."""
        self.calls: dict[str, int] = {}
        self.settled: dict[str, float | list[float]] = {}
        """Agents given their reward by `settle` (done in this episode)."""
        self.last_done: Call | None = None
        self.threads: dict[str, list[Thread]] = {}

    def thread_for(self, agent: str, messages: list[dict]) -> tuple[Thread, bool]:
        """The idle thread of `agent` these messages continue, or a new one; and whether the
        prompt is then tokenised fresh from a history (`retokenizes`)."""
        threads = self.threads.setdefault(agent, [])
        t = next((t for t in threads if t.continued_by(messages)), None)
        fresh = retokenizes(messages, t is not None)
        if t is None:
            t = Thread(self.runner.new_conversation(agent))
            threads.append(t)
        t.busy = True
        return t, fresh

    async def chat(self, agent: str, messages: list[dict], *, max_tokens: int | None = None,
                   temperature: float | None = None, top_p: float | None = None,
                   tools: list[dict] | None = None, prefill: str = "") -> Reply:
        """Ask `agent` to answer `messages` (OpenAI-style dicts, `role` and `content`); the
        reply is sampled with the agent's current weights. max_tokens: at most
        workflow.max_new_tokens (the default). temperature (> 0), top_p (in (0, 1]): this
        call's own, default the run's rollout.temperature / rollout.top_p; the sample keeps
        the log-probs it was drawn with, and the trainer's importance weight corrects for
        the difference from rollout.temperature, at which it scores (docs/episodes.md).
        tools: OpenAI-style function schemas (`ctx.tool_schema(name)`), rendered by the
        agent's chat template; the reply's tool calls are then parsed (`Reply.tool_calls`).
        prefill: text the reply must start with (the OpenAI endpoint's forced tool call): put
        after the rendered prompt and part of it, so not sampled and out of the loss; the
        policy samples the rest, and `Reply.text` is prefill + the sampled text."""
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"ctx.chat(tools=...): expected a list of JSON schema dicts, got {tools!r:.200}")
        if not isinstance(prefill, str):
            raise ValueError(f"ctx.chat(prefill=...): expected a string, got {type(prefill).__name__}")
        sampling = self.runner.call_sampling(temperature, top_p)
        cap = self.runner.max_new_tokens
        if agent not in self.runner.agents:
            raise ValueError(f"ctx.chat: no agent {agent!r} (workflow.agents: {self.runner.agents})")
        if agent in self.settled:
            raise ValueError(f"ctx.chat({agent!r}): the agent was settled in this episode (ctx.settle)")
        n = cap if max_tokens is None else int(max_tokens)
        if not 1 <= n <= cap:
            raise ValueError(f"ctx.chat(max_tokens={max_tokens!r}): expected 1..{cap} (workflow.max_new_tokens)")
        index = self.calls.get(agent, 0)
        messages = [dict(m) for m in messages]
        thread, fresh = self.thread_for(agent, messages)
        # only what is given: a conversation that knows neither (a test's fake) still serves plain calls
        given = {k: v for k, v in (("tools", tools), ("prefill", prefill)) if v}
        rerendered = getattr(thread.conv, "rerendered", 0)
        prompt = thread.conv.prompt_ids(messages, **given)
        prefill_len = thread.conv.prefill_len if prefill else 0
        # a continued thread whose template rendered the earlier turns otherwise (Qwen3 drops
        # past thinking) was encoded from its text as well
        fresh = fresh or getattr(thread.conv, "rerendered", 0) > rerendered
        room = self.runner.limits.get(agent, 1 << 62) - len(prompt)
        if room < 1:
            thread.busy = False
            # not counted as a call: no node exists for it (the episode's calls are its nodes)
            raise ContextFull(f"ctx.chat({agent!r}): a prompt of {len(prompt)} tokens leaves no room "
                              f"in the agent's context of {self.runner.limits[agent]} tokens")
        self.calls[agent] = index + 1
        n = min(n, room)                      # the reply is cut where the context ends
        call = Call(self, agent, index, prompt, n, self.last_done, thread, messages,
                    asyncio.get_running_loop().create_future(), sampling, tools, prefill, prefill_len, fresh)
        self.runner.new_calls.append(call)
        return await call.future

    def settle(self, agent: str, reward: float | list[float]) -> None:
        """`agent`'s reward in this episode, now: one float, or one per call so far. The agent
        is done here (a later ctx.chat to it raises); its calls become trainable once every
        episode of the example has settled it or ended, not when this episode ends."""
        if agent in self.settled:
            raise ValueError(f"ctx.settle({agent!r}): settled twice in one episode")
        if any(t.busy for t in self.threads.get(agent, ())):
            raise ValueError(f"ctx.settle({agent!r}): a call of the agent is still in flight")
        calls = {agent: self.calls.get(agent, 0)}
        self.settled[agent] = check_rewards({agent: reward}, calls, self.runner.agents)[agent]
        self.runner.settled.append((self, agent))

    async def tool(self, name: str, argument: str):
        """Run a bundled tool (`calculator`, `python`: tools/registry.py) on a worker, off
        the orchestrator's loop; never raises: a failed call's output is an error string
        and its `outcome` says why. Recorded in the store's /tools."""
        return await self.runner.tool(self, name, argument)

    def tool_schema(self, name: str) -> dict:
        """The JSON schema of a tool by name (built-in, or a user's: tools.functions), for
        `ctx.chat(..., tools=[...])`."""
        from flexmarl_hpc.tools.functions import schema
        return schema(name, self.runner.user_tools)

    async def run_tools(self, reply: Reply) -> list[dict]:
        """Run the reply's tool calls at once, each in the sandbox or on its worker, and return
        their results as `tool` messages in the reply's order; an unreadable block or
        arguments that do not fit the tool get an error message (the model's to read)."""
        done = dict(zip([r.id for r in reply.tool_calls], await self.run_tool_requests(reply.tool_calls)))
        done.update({e.id: tool_message(e.id, "", f"error: cannot read the tool call: {e.error}")
                     for e in reply.tool_errors})
        return [done[k] for k in sorted(done, key=lambda cid: int(cid.rsplit("-", 1)[1]))]

    async def run_tool_requests(self, requests, *, lent: bool = False) -> list[dict]:
        """`run_tools` of these calls, their `tool` messages in the same order. lent: the
        caller holds a worker slot while it waits on them (an `openai` program asking its
        endpoint to run its calls), so they run in its stead, never waiting on a slot (with
        every slot held by such a program they would wait for ever)."""
        from flexmarl_hpc.tools.functions import argument_text

        async def one(req: ToolRequest) -> dict:
            try:
                text = argument_text(req.name, req.arguments, self.runner.user_tools)
            except ValueError as e:
                if self.runner.record_tool is not None:
                    self.runner.record_tool(self, req.name, "refused", 0.0)
                return tool_message(req.id, req.name, f"error: {e}")
            return tool_message(req.id, req.name, (await self.runner.tool(self, req.name, text, lent=lent)).output)

        return list(await asyncio.gather(*map(one, requests)))

    async def call(self, fn: Callable, *args, timeout_s: float | None = None):
        """`fn(*args)` (a module-level function: a reward, a test harness) in a worker process;
        returns tools.pool.Called (value, outcome, latency); timeouts and crashes are outcomes."""
        return await self.runner.call(self, fn, *args, timeout_s=timeout_s)


@dataclass(frozen=True)
class EpisodeError:
    """Why an episode failed: the exception's type name (the failure's kind), its message and
    the formatted traceback (store /failures, train.log)."""
    kind: str
    message: str
    traceback: str

    @classmethod
    def of(cls, e: BaseException) -> "EpisodeError":
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        return cls(type(e).__name__, str(e), tb)


@dataclass
class Finished:
    """An episode that returned (or raised: `failure`)."""
    ctx: EpisodeContext
    rewards: dict[str, float | list[float]]
    failure: EpisodeError | None = None

    @property
    def error(self) -> str:
        """'Kind: message', or "" for an episode that returned."""
        return "" if self.failure is None else f"{self.failure.kind}: {self.failure.message}"


class EpisodeRunner:
    """Runs episode coroutines on its own asyncio loop, stepped by the host."""

    def __init__(self, fn: Callable[..., Awaitable[dict]], agents: list[str], seed: int,
                 max_new_tokens: int, new_conversation: Callable[[str], Any], args: dict | None = None,
                 tools=None, record_tool: Callable | None = None, limits: dict[str, int] | None = None,
                 sampling: tuple[float, float] = (1.0, 1.0), tool_formats: dict[str, str] | None = None,
                 user_tools: dict | None = None):
        self.fn, self.agents, self.seed = fn, list(agents), seed
        self.max_new_tokens, self.new_conversation = max_new_tokens, new_conversation
        self.args = dict(args or {})
        self.pool, self.record_tool = tools, record_tool
        self.limits = dict(limits or {})
        """Most tokens of one call (prompt + reply) per agent; missing: no limit."""
        self.sampling = sampling
        """The run's (rollout.temperature, rollout.top_p): what a call's own values replace."""
        self.tool_formats = dict(tool_formats or {})
        """Each agent's model.tool_format (default hermes): how its replies' tool calls are parsed."""
        self.user_tools = dict(user_tools or {})
        """tools.functions read from their files (config/tools.py FunctionSpec), by name."""
        self.loop = asyncio.new_event_loop()
        self.new_calls: list[Call] = []
        self.finished: list[Finished] = []
        self.settled: list[tuple[EpisodeContext, str]] = []
        """(episode, agent) settled since the last `take_settled`."""
        self.running = 0
        self.tools_in_flight = 0
        self.closers: list[Callable[[], None]] = []
        """Run at `close`, after the episodes are cancelled (the OpenAI endpoint's server)."""
        self.agent_wait_s = 3600.0
        """Most seconds an OpenAI endpoint request waits for its reply (workflow.agent_timeout_s)."""

    def start(self, step: int, example_id: int, episode: int, example: dict) -> EpisodeContext:
        ctx = EpisodeContext(self, step, example_id, episode, self.args)
        self.running += 1
        self.loop.create_task(self._run(ctx, example))
        return ctx

    async def _run(self, ctx: EpisodeContext, example: dict) -> None:
        try:
            rewards = await self.fn(ctx, example)
            late = sorted(set(rewards) & set(ctx.settled)) if isinstance(rewards, dict) else []
            if late:
                raise ValueError(f"reward returned for {late}, settled earlier (ctx.settle)")
            unsettled = {a: n for a, n in ctx.calls.items() if a not in ctx.settled}
            self.finished.append(Finished(ctx, {**check_rewards(rewards, unsettled, self.agents), **ctx.settled}))
        except Exception as e:          # noqa: BLE001 - the user's episode: a counted event
            self.finished.append(Finished(ctx, dict(ctx.settled), EpisodeError.of(e)))
        finally:
            self.running -= 1

    def step(self) -> None:
        """Run every episode until it waits on a reply or tool not yet in (no blocking:
        pending I/O callbacks of finished tool calls are run too)."""
        for _ in range(1000):                # callbacks chain (a reply resolves a future ...)
            self.loop.call_soon(self.loop.stop)
            self.loop.run_forever()
            if not self.loop._ready:         # noqa: SLF001 - nothing left runnable
                return

    def call_sampling(self, temperature, top_p) -> tuple[float, float] | None:
        """A call's own (temperature, top_p), the run's where one is not given; None when
        neither is (the batch's params). ValueError naming the argument if out of range."""
        if temperature is None and top_p is None:
            return None
        t = self.sampling[0] if temperature is None else temperature
        p = self.sampling[1] if top_p is None else top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 100:
            raise ValueError(f"ctx.chat(temperature={temperature!r}): expected a number in (0, 100]")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"ctx.chat(top_p={top_p!r}): expected a number in (0, 1]")
        return float(t), float(p)

    def waiting(self) -> bool:
        """Some episode waits on a tool, a worker call or a timer (not on a reply)."""
        return bool(self.tools_in_flight or self.loop._scheduled)      # noqa: SLF001

    def take(self) -> tuple[list[Call], list[Finished]]:
        calls, done = self.new_calls, self.finished
        self.new_calls, self.finished = [], []
        return calls, done

    def take_settled(self) -> list[tuple[EpisodeContext, str]]:
        """(episode, agent) settled since the last call, in order (before `take`'s Finished)."""
        out, self.settled = self.settled, []
        return out

    async def tool(self, ctx: EpisodeContext, name: str, argument: str, lent: bool = False):
        if self.pool is None:
            raise RuntimeError("ctx.tool: this run has no tool pool")
        self.tools_in_flight += 1
        try:
            res = await (self.pool.tool(name, argument, lent=True) if lent else self.pool.tool(name, argument))
        finally:
            self.tools_in_flight -= 1
        if self.record_tool is not None:
            self.record_tool(ctx, name, res.outcome, res.latency_s)
        return res

    async def call(self, ctx: EpisodeContext, fn, *args, timeout_s=None):
        if self.pool is None:
            raise RuntimeError("ctx.call: this run has no worker pool")
        self.tools_in_flight += 1
        try:
            res = await self.pool.call(fn, *args, timeout_s=timeout_s)
        finally:
            self.tools_in_flight -= 1
        if self.record_tool is not None:
            self.record_tool(ctx, getattr(fn, "__name__", "call"), res.outcome, res.latency_s)
        return res

    def close(self) -> None:
        """Cancel the episodes still running (a run that ends or stops) and end the pool."""
        tasks = asyncio.all_tasks(self.loop)
        for t in tasks:
            t.cancel()
        if tasks:
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        for close in self.closers:
            close()
        if self.pool is not None:
            self.pool.close()
        self.loop.close()


def check_rewards(rewards: Any, calls: dict[str, int], agents: list[str]) -> dict[str, float | list[float]]:
    """An episode's return value as {agent: float or one float per call}; raises ValueError
    saying what is wrong (the episode then counts as failed)."""
    if not isinstance(rewards, dict):
        raise ValueError(f"an episode must return {{agent: reward}}, got {type(rewards).__name__}")
    out: dict[str, float | list[float]] = {}
    for agent, r in rewards.items():
        if agent not in agents:
            raise ValueError(f"reward for unknown agent {agent!r} (workflow.agents: {agents})")
        if isinstance(r, (list, tuple)):
            if len(r) != calls.get(agent, 0):
                raise ValueError(f"{len(r)} rewards for {agent!r}, which was called {calls.get(agent, 0)} times")
            out[agent] = [float(x) for x in r]
        else:
            out[agent] = float(r)
        if not all(map(math.isfinite, out[agent] if isinstance(out[agent], list) else [out[agent]])):
            # a NaN would reach the trainer as a NaN advantage (the gate refuses it: issue 35)
            raise ValueError(f"reward for {agent!r} is not a finite number: {r!r}")
    missing = [a for a, n in calls.items() if n and a not in out]
    if missing:
        raise ValueError(f"no reward for {missing} (called in the episode)")
    return out


def call_reward(rewards: dict, agent: str, index: int) -> float:
    r = rewards.get(agent, 0.0)
    return float(r[index]) if isinstance(r, list) else float(r)


def load_episode(spec: str) -> Callable:
    """Import `module:function`, an `async def episode(ctx, example)`."""
    from flexmarl_hpc.config.schema import ConfigError
    mod_name, _, fn_name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError, ValueError, SyntaxError) as e:   # (launch: episode_check.py)
        raise ConfigError(f"workflow.episode: cannot import {spec!r}: {' '.join(str(e).split())}") from None
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"workflow.episode: {spec!r} is not an `async def episode(ctx, example)`")
    return fn
