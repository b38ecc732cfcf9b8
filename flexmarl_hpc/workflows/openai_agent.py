"""Agents written against the official `openai` client, trained unchanged (`workflow.agent`).

    def main(base_url, example):            # workflow.agent: my_pkg.my_agent:main (or async def)
        client = OpenAI(base_url=base_url, api_key="-")
        r = client.chat.completions.create(model="writer", messages=[...])
        return {"writer": 1.0}               # or nothing, with workflow.reward

Each episode is `episode` below (an ordinary episode function on the orchestrator's loop):
it opens its own base URL on a loopback HTTP server of the runner and runs the user's
program with it in a worker process of the tool pool (`ctx.call`, never on the
orchestrator's loop). Each `POST /v1/chat/completions` is parsed (openai_api.py) and
becomes `ctx.chat` calls of the agent named as the model, on the episode's loop: the same
chat template, the same token-exact conversations, the same scheduling, staleness and
store as any episode's calls. With `tools`, the reply's tool calls go back as OpenAI
`tool_calls`, and `POST {base_url}/run_tools` runs a program's calls as `ctx.run_tools` does
(the sandbox), in the program's worker slot. The server runs in threads (the standard library's
`http.server`: no protocol written here); a request waits on its calls' future, which the
orchestrator completes while it steps the episodes (it polls them every 20 ms while the
program, a worker call, is in flight: docs/episodes.md).
"""
from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json
import os
import secrets
import threading
from concurrent.futures import CancelledError as FutureCancelled, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from flexmarl_hpc.config.schema import AGENT_EPISODE  # noqa: F401 - workflow.episode of these runs
from flexmarl_hpc.workflows.episode import ContextFull, Reply
from flexmarl_hpc.workflows.openai_api import (ApiError, ChatRequest, Choice, completion, cut_at_stop, models,
                                               parse_request, parse_run_tools)
from flexmarl_hpc.workflows.toolcalls import CONTENT, PREFILL, ToolRequest, parser_for

MAX_BODY = 64 << 20
"""Largest request body read (64 MiB): a longer one is refused before it is read."""


class AgentProgramError(RuntimeError):
    """The user's program raised, crashed or returned no usable rewards (the episode fails)."""


class WorkerTraceback(Exception):
    """The traceback of the user's program in its worker process (the cause of an AgentProgramError)."""


class AgentTimeout(RuntimeError):
    """The user's program ran past workflow.agent_timeout_s (its worker process is killed)."""


@dataclass(frozen=True)
class AgentProgram:
    """What the episode needs of the config (workflow.agent, .reward, .agent_timeout_s)."""
    spec: str
    reward: str = ""
    timeout_s: float = 600.0


@dataclass(eq=False)
class Endpoint:
    """One episode's endpoint: its requests become its calls; `transcript` is what the
    reward function gets (agent, messages, reply text per call, in order of replies)."""
    ctx: object
    transcript: list[dict] = field(default_factory=list)
    requests: int = 0

    sent: dict[str, tuple[dict, dict]] = field(default_factory=dict)
    """First tool-call id of each reply returned with tool calls -> (the assistant message as
    a follow-up request carries it back, parsed; the reply as sampled: `Reply.message`)."""

    async def complete(self, req: ChatRequest, request_id: str) -> dict | ApiError:
        self.requests += 1
        messages = [self.as_sampled(m) for m in req.messages]
        try:
            replies = await asyncio.gather(*(self.ctx.chat(req.agent, messages, max_tokens=req.max_tokens,
                                                           temperature=req.temperature, top_p=req.top_p,
                                                           tools=list(req.tools) or None, prefill=self.prefill(req))
                                             for _ in range(req.n)))
        except ContextFull as e:
            return ApiError(400, str(e), "messages", "context_length_exceeded")
        except ValueError as e:                 # e.g. an agent settled in this episode
            return ApiError(400, str(e), None, "invalid_request")
        choices = [self.choice(req, r) for r in replies]
        for r, c in zip(replies, choices):
            self.transcript.append({"agent": req.agent, "call": r.call, "messages": req.messages, "reply": c.text,
                                    "tool_calls": [{"id": i, "name": n, "arguments": a} for i, n, a in c.tool_calls],
                                    "retokenized": r.retokenized})     # the episode layer's (its /samples row's)
        unmet = [i for i, c in enumerate(choices) if req.forced and not forced_call_made(req, c)]
        if unmet:
            return tool_choice_unmet(req, unmet, choices)
        return completion(request_id, req.agent, choices)

    def prefill(self, req: ChatRequest) -> str:
        """The reply's forced opening (tool_choice 'required' or a named function) in the
        agent's tool-call format, or "" (the policy samples all of it)."""
        if not req.forced:
            return ""
        return PREFILL[self.ctx.runner.tool_formats.get(req.agent, "hermes")](req.function or None)

    def choice(self, req: ChatRequest, r: Reply) -> Choice:
        """One reply as OpenAI's choice: cut at a stop string (looked for in the sampled
        text, after any prefill), its tool calls (those before the cut; none with tool_choice
        'none') parsed in the agent's format, as ctx.chat does."""
        head = self.prefill(req)
        text, stopped = cut_at_stop(r.text[len(head):], req.stop)
        text = head + text
        fmt, calls = self.ctx.runner.tool_formats.get(req.agent, "hermes"), ()
        if req.tools and req.tool_choice != "none":
            calls = r.tool_calls if not stopped else tuple(parser_for(fmt)(text, f"{req.agent}-{r.call}")[0])
        if not calls:
            return Choice(text, "length" if r.truncated and not stopped else "stop", r.prompt_len, len(r.ids))
        out = tuple((c.id, c.name, c.arguments) for c in calls)
        content = CONTENT[fmt](text) or None
        choice = Choice(content, "tool_calls", r.prompt_len, len(r.ids), out)
        # the program sends this message back with its tool results: it then stands for the
        # reply as sampled, so the follow-up's prompt continues the sampled ids
        as_parsed = {**choice.message(), "content": content or "",
                     "tool_calls": [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                    for i, n, a in out]}
        self.sent[out[0][0]] = (as_parsed, r.message)
        return choice

    def as_sampled(self, m: dict) -> dict:
        """A message as the conversation recorded it: an assistant message with the tool calls
        of a reply, unchanged, is that reply as sampled; any other (edited) stays as it is,
        and the template renders its calls afresh (the prompt is then re-tokenised)."""
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        sent = self.sent.get(calls[0]["id"]) if calls else None
        return sent[1] if sent is not None and sent[0] == m else m

    async def run_tools(self, calls: list[dict]) -> list[dict]:
        """POST {base_url}/run_tools: the program's tool calls run as ctx.run_tools runs a
        reply's (the sandbox, tools.functions, /tools rows), in the program's worker slot."""
        reqs = [ToolRequest(c["function"]["name"], c["function"]["arguments"], c["id"]) for c in calls]
        return await self.ctx.run_tool_requests(reqs, lent=True)


def forced_call_made(req: ChatRequest, c: Choice) -> bool:
    """The reply's first call block (the prefilled one: id '<agent>-<call>-0') parsed into a
    call of the function tool_choice names ('required': of one of the tools)."""
    if not c.tool_calls or not c.tool_calls[0][0].endswith("-0"):
        return False
    names = [req.function] if req.tool_choice == "function" else [t["function"]["name"] for t in req.tools]
    return c.tool_calls[0][1] in names


def tool_choice_unmet(req: ChatRequest, unmet: list[int], choices: list[Choice]) -> ApiError:
    """The 422 of a forced call the model did not complete. OpenAI guarantees the call
    (constrained decoding); we prefill its opening and the policy samples the rest, which
    may break the JSON or run out of tokens. Not retried here: a retry is another sample of
    the agent, and these replies already are samples of this episode (they are trained with
    its reward). A 4xx, so the client does not retry on its own (it retries 5xx)."""
    want = f"function {req.function!r}" if req.tool_choice == "function" else "'required'"
    c = choices[unmet[0]]
    return ApiError(422, f"tool_choice {want}: choice {unmet[0]} (of {len(unmet)} of {len(choices)} not met) is no "
                    f"call of {req.function if req.function else 'one of the tools'}: its opening was prefilled "
                    f"and the policy wrote the rest (no constrained decoding), finish_reason {c.finish_reason!r}; "
                    f"the reply stays a sample of the agent; as sampled: {(c.text or '')[:300]!r}",
                    "tool_choice", "tool_choice_not_met", "model_error")


@dataclass(frozen=True)
class RelayedURL:
    """The base URL of an episode's endpoint as a program on a tool rank gets it: only the
    route (`/ep/<token>/v1`); the tool rank makes it a URL of its own loopback relay
    (ranks/tool_ranks.py), which forwards each request over MPI to this server's routes."""
    path: str


class Server:
    """The runner's loopback HTTP server: episode `token` is served under /ep/<token>/v1.
    A tool rank's relay forwards its programs' requests to `answer_here` instead."""

    def __init__(self, loop: asyncio.AbstractEventLoop, agents: list[str], max_new_tokens: int, wait_s: float):
        self.loop, self.agents, self.max_new_tokens, self.wait_s = loop, list(agents), max_new_tokens, wait_s
        self.routes: dict[str, Endpoint] = {}
        self.httpd, self.thread = serve_http(self)

    def open(self, endpoint: Endpoint) -> tuple[str, str]:
        """(token, base URL) of a new route; the token is random, so one episode's program
        cannot reach another's by guessing."""
        token = secrets.token_hex(12)
        self.routes[token] = endpoint
        return token, f"http://127.0.0.1:{self.httpd.server_address[1]}/ep/{token}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(self, method: str, token: str, tail: str, body: bytes) -> tuple[int, dict]:
        """(status, JSON) for a request to /ep/<token>/<tail>, from a server thread."""
        out = self.route(method, token, tail, body)
        return out if isinstance(out, tuple) else self.wait(out)

    async def answer_here(self, method: str, token: str, tail: str, body: bytes) -> tuple[int, dict]:
        """`answer` on the episodes' loop: a request a tool rank's relay forwarded."""
        out = self.route(method, token, tail, body)
        return out if isinstance(out, tuple) else _status(await out)

    def route(self, method: str, token: str, tail: str, body: bytes):
        """(status, JSON) when the answer is known at once, else the coroutine that makes it
        on the episodes' loop (a completion's calls, a program's tool calls)."""
        endpoint = self.routes.get(token)
        if endpoint is None:
            return 404, ApiError(404, "no such episode endpoint (it has ended)", None, "not_found").body()
        if method == "GET":
            return (200, models(self.agents)) if tail == "v1/models" else \
                (404, ApiError(404, f"GET /{tail}: only GET /v1/models is served", None, "not_found").body())
        if tail not in ("v1/chat/completions", "v1/run_tools"):
            return 404, ApiError(404, f"POST /{tail}: only POST /v1/chat/completions and /v1/run_tools are served",
                                 None, "not_found").body()
        try:
            data = json.loads(body)
        except ValueError as e:
            return 400, ApiError(400, f"the body is not JSON: {e}").body()
        if tail == "v1/run_tools":
            calls = parse_run_tools(data)
            return (calls.status, calls.body()) if isinstance(calls, ApiError) else self._tool_results(endpoint, calls)
        req = parse_request(data, self.agents, self.max_new_tokens)
        if isinstance(req, ApiError):
            return req.status, req.body()
        return endpoint.complete(req, f"chatcmpl-{token[:8]}-{endpoint.requests}")

    @staticmethod
    async def _tool_results(endpoint: Endpoint, calls: list[dict]) -> dict:
        return {"object": "list", "messages": await endpoint.run_tools(calls)}

    def wait(self, coro) -> tuple[int, dict]:
        """(status, JSON) of `coro` run on the episodes' loop, from a server thread."""
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
            out = fut.result(self.wait_s)
        except (RuntimeError, FutureCancelled, FutureTimeout) as e:       # the run ends or stops
            return 503, ApiError(503, f"the episode ended before the reply ({type(e).__name__})", None,
                                 "unavailable", "server_error").body()
        return _status(out)


def _status(out: dict | ApiError) -> tuple[int, dict]:
    return (out.status, out.body()) if isinstance(out, ApiError) else (200, out)


def serve_http(owner) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """A loopback HTTP server whose requests `owner.answer(method, token, tail, body)`
    answers (this runner's Server, or a tool rank's relay), in threads of its own."""
    httpd = _QuietServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.owner = owner
    thread = threading.Thread(target=httpd.serve_forever, name="openai-endpoint", daemon=True)
    thread.start()
    return httpd, thread


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        # a program killed at its timeout leaves its request's socket closed: the late reply
        # finds no reader, which is no error of the run (socketserver would print a traceback)
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"           # keep-alive: the client reuses its connection
    # headers and body go out as two writes: with Nagle's algorithm the body waits for the
    # client's delayed ACK (bench/bench_openai_endpoint.py: 103 -> 49 ms a completion)
    disable_nagle_algorithm = True

    def do_POST(self):                      # noqa: N802 - http.server's name
        token, tail = self._route()
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            self.close_connection = True
            return self._send(413, ApiError(413, f"a body of {n} bytes: at most {MAX_BODY}").body())
        body = self.rfile.read(n)
        self._send(*self.server.owner.answer("POST", token, tail, body))

    def do_GET(self):                       # noqa: N802
        self._send(*self.server.owner.answer("GET", *self._route(), b""))

    def _route(self) -> tuple[str, str]:
        parts = self.path.split("?")[0].strip("/").split("/", 2)
        return (parts[1], parts[2]) if len(parts) == 3 and parts[0] == "ep" else ("", "/".join(parts))

    def _send(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:   # one line per request would flood train.log
        pass


def server_of(runner) -> Server:
    """The runner's server, started on its first agent episode and closed with the runner."""
    server = getattr(runner, "openai_server", None)
    if server is None:
        server = runner.openai_server = Server(runner.loop, runner.agents, runner.max_new_tokens,
                                               runner.agent_wait_s)
        runner.closers.append(server.close)
        if relayed(runner):
            runner.pool.endpoint = server.answer_here
    return server


def relayed(runner) -> bool:
    """The runner's programs run on tool ranks (ranks/tool_ranks.py RemotePool: tools.ranks
    > 0), maybe on other nodes: they reach the endpoint through their rank's relay."""
    return bool(getattr(runner.pool, "relays_endpoints", False))    # (ranks/ is above workflows/)


async def episode(ctx, example, *, program: AgentProgram):
    """The episode of an `openai` program: its own endpoint, the program run in a worker with
    it, then the rewards (the program's, or workflow.reward's)."""
    server = server_of(ctx.runner)
    endpoint = Endpoint(ctx)
    token, base_url = server.open(endpoint)
    where = RelayedURL(f"/ep/{token}/v1") if relayed(ctx.runner) else base_url
    try:
        ran = await ctx.call(run_program, program.spec, where, example, timeout_s=program.timeout_s)
    finally:
        del server.routes[token]
    result = _value(ran, f"workflow.agent {program.spec!r}")
    if not program.reward:
        if result is None:
            raise AgentProgramError(f"workflow.agent {program.spec!r} returned None: return "
                                    "{agent: reward} or name a reward function in workflow.reward")
        return reward_metrics(ctx, result)
    scored = await ctx.call(run_reward, program.reward, example, result, endpoint.transcript,
                            timeout_s=program.timeout_s)
    return reward_metrics(ctx, _value(scored, f"workflow.reward {program.reward!r}"))


def reward_metrics(ctx, rewards):
    """`rewards`, each agent's mean also put in ctx.metrics as `<agent>_reward`: the program
    cannot reach ctx.metrics, so this is what held-out evaluation (run.eval_every,
    scripts/eval_heldout.py) averages. Rewards it cannot read are left to the runner's check."""
    for agent, r in (rewards.items() if isinstance(rewards, dict) else ()):
        values = r if isinstance(r, (list, tuple)) else [r]
        if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            ctx.metrics[f"{agent}_reward"] = sum(values) / len(values)
    return rewards


def _value(called, what: str):
    if called.outcome == "timeout":
        raise AgentTimeout(f"{what}: {called.error}")
    if called.outcome != "ok":
        # the worker's traceback rides as the cause: the /failures row and train.log show the
        # line of the user's program that raised, not only this one
        raise AgentProgramError(f"{what}: {called.outcome}: {called.error}") from \
            (WorkerTraceback(called.traceback) if called.traceback else None)
    return called.value


def agent_episode(w) -> functools.partial:
    """The episode function of workflow `w` (workflow.agent set)."""
    return functools.partial(episode, program=AgentProgram(w.agent, w.reward, w.agent_timeout_s))


@functools.cache
def load_program(spec: str):
    """`module:function` of the user's program or reward function (a worker imports it once)."""
    mod_name, _, fn_name = spec.partition(":")
    fn = getattr(importlib.import_module(mod_name), fn_name)
    if not callable(fn):
        raise TypeError(f"{spec!r} is not a function")
    return fn


def run_program(spec: str, base_url: str, example: dict):
    """In a worker process: the user's program on `(base_url, example)`, awaited when it is
    async. The URL is also OPENAI_BASE_URL (and OPENAI_API_KEY, when unset, a placeholder),
    so a program that builds `OpenAI()` from the environment runs unchanged too."""
    if not isinstance(base_url, str):           # a RelayedURL no tool rank made a URL of
        raise TypeError(f"run_program: expected the endpoint's URL, got {base_url!r}")
    os.environ["OPENAI_BASE_URL"] = base_url
    os.environ.setdefault("OPENAI_API_KEY", "flexmarl")
    return _awaited(load_program(spec), base_url, example)


def run_reward(spec: str, example: dict, result, transcript: list[dict]):
    """In a worker process: workflow.reward on (example, the program's return value, the
    transcript: one {agent, call, messages, reply} per call, in order of replies)."""
    return _awaited(load_program(spec), example, result, transcript)


class ProgramRaised(Exception):
    """What the user's program raised, as its type name and message: the exception itself
    may not unpickle in the parent (the `openai` client's errors need their response), and
    one that does not unpickle breaks the worker pool and loses the program's traceback."""


def _awaited(fn, *args):
    try:
        out = fn(*args)
        return asyncio.run(out) if inspect.iscoroutine(out) else out
    except Exception as e:                       # noqa: BLE001 - the user's: reported as the episode's failure
        # chained, so the worker's traceback (the program's own lines) still rides to /failures
        raise ProgramRaised(f"{type(e).__name__}: {e}") from e
