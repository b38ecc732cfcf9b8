"""The OpenAI chat-completions request and response, as the endpoint of `workflow.agent`
serves them (workflows/openai_agent.py; docs/episodes.md#agents-written-against-openai).

Pure: a request body (the JSON the official `openai` client sends) becomes a `ChatRequest`
or an `ApiError` (the HTTP status and OpenAI's error object), and a list of replies becomes
a `chat.completion` object. No I/O here: the server and the episode are in openai_agent.py.

    req = parse_request(body, agents=["writer", "critic"], max_new_tokens=128)
    if isinstance(req, ApiError): send(req.status, req.body())
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

SERVED = ("messages", "model", "temperature", "top_p", "max_tokens", "max_completion_tokens", "n",
          "stop", "tools", "tool_choice", "parallel_tool_calls", "stream", "user")
"""Request fields the endpoint reads (`user` is accepted and ignored: it only names the caller)."""
REFUSED_WHY = {
    "logprobs": "log-probs are the trainer's (the sample keeps them); not returned",
    "top_logprobs": "log-probs are the trainer's (the sample keeps them); not returned",
    "seed": "sampling is seeded by the run (run.seed, agent, version, sample id), not per request",
    "presence_penalty": "a penalty changes the sampled distribution away from the policy's",
    "frequency_penalty": "a penalty changes the sampled distribution away from the policy's",
    "logit_bias": "a bias changes the sampled distribution away from the policy's",
    "response_format": "constrained decoding changes the sampled distribution away from the policy's",
    "stream_options": "only stream=false is served",
    "functions": "the deprecated functions API: use tools",
    "function_call": "the deprecated functions API: use tool_choice",
}
"""Why a known OpenAI field is refused; any other unknown field is refused too."""
ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")
MAX_N = 64
MAX_STOP = 4


@dataclass(frozen=True)
class ApiError:
    """An OpenAI-style error: HTTP status and the `error` object the client raises from."""
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    """What the episode needs of one request: an agent's call (or `n` parallel ones)."""
    agent: str
    messages: list[dict]
    """Normalised: OpenAI's None-valued keys and response-only keys (refusal, annotations,
    audio) dropped, content parts joined, so an assistant message the program copied from a
    response equals the one the episode recorded and the conversation continues token-exact."""
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    n: int = 1
    stop: tuple[str, ...] = ()
    tools: tuple[dict, ...] = ()
    """Function schemas as the chat template reads them ({"type": "function", "function":
    {name, description, parameters}}); rendered into the prompt (ctx.chat(tools=))."""
    tool_choice: str = "auto"
    """'auto': the reply's tool calls are parsed and returned; 'none': the tools are still
    rendered (as vLLM does) but the reply is returned as text, unparsed; 'required' (a call
    of any of `tools`) and 'function' (a call of `function`): the reply is prefilled with
    the call's opening in the agent's format and the policy samples the rest (no grammar:
    a reply that is no such call is a 422 naming tool_choice, see openai_agent.py)."""
    function: str = ""
    """The function tool_choice 'function' names (one of `tools`)."""

    @property
    def forced(self) -> bool:
        """The request asks for a tool call (tool_choice 'required' or a named function)."""
        return self.tool_choice in ("required", "function")


class _Bad(Exception):
    def __init__(self, param: str, message: str, code: str | None = None):
        super().__init__(message)
        self.param, self.message, self.code = param, message, code


def parse_request(body, agents: list[str], max_new_tokens: int) -> ChatRequest | ApiError:
    """`body` (decoded JSON) as a ChatRequest, or the ApiError to send back."""
    if not isinstance(body, dict):
        return ApiError(400, f"expected a JSON object, got {type(body).__name__}")
    unknown = [k for k in body if k not in SERVED]
    if unknown:
        k = unknown[0]
        why = REFUSED_WHY.get(k, "not an OpenAI chat-completions field this endpoint serves")
        return ApiError(400, f"Unsupported parameter: '{k}': {why} (served: {', '.join(SERVED)})",
                        k, "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return ApiError(400, "you must provide a model parameter (the agent's name)", "model", "missing_required_parameter")
    if model not in agents:
        return ApiError(404, f"The model '{model}' does not exist: this endpoint serves the agents "
                        f"{agents} (workflow.agents)", "model", "model_not_found")
    try:
        _no_stream(body)
        tools = _tools(body.get("tools"))
        return ChatRequest(model, _messages(body.get("messages")), _max_tokens(body, max_new_tokens),
                           _number(body, "temperature", 0, 2, open_lo=True), _number(body, "top_p", 0, 1, open_lo=True),
                           _n(body.get("n")), _stop(body.get("stop")), tools, *_tool_choice(body, tools))
    except _Bad as e:
        return ApiError(400, e.message, e.param, e.code or "invalid_value")


def parse_run_tools(body) -> list[dict] | ApiError:
    """The body of POST {base_url}/run_tools (`{"tool_calls": [...]}`, as a response's
    message holds them) as [{id, type, function: {name, arguments: dict}}], or the ApiError."""
    calls = body.get("tool_calls") if isinstance(body, dict) else None
    if not isinstance(calls, list) or not calls:
        return ApiError(400, "expected {\"tool_calls\": [...]}: a non-empty list, as a reply's message holds them",
                        "tool_calls", "missing_required_parameter")
    try:
        return [_tool_call(f"tool_calls[{j}]", c) for j, c in enumerate(calls)]
    except _Bad as e:
        return ApiError(400, e.message, e.param, e.code or "invalid_value")


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise _Bad("messages", "messages: expected a non-empty list of messages", "missing_required_parameter")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise _Bad(where, f"{where}: expected an object with a role of {list(ROLES)}")
    out = {k: m[k] for k in MESSAGE_KEYS if m.get(k) is not None}
    if "tool_calls" in out:
        if out["role"] != "assistant":
            raise _Bad(f"{where}.tool_calls", f"{where}.tool_calls: only an assistant message carries tool calls")
        out["tool_calls"] = [_tool_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(out["tool_calls"])] \
            if isinstance(out["tool_calls"], list) else _bad_list(f"{where}.tool_calls")
        if not out["tool_calls"]:
            del out["tool_calls"]
    if out["role"] == "tool" and not (isinstance(out.get("tool_call_id"), str) and out["tool_call_id"]):
        raise _Bad(f"{where}.tool_call_id", f"{where}.tool_call_id: a tool message names the call it answers",
                   "missing_required_parameter")
    content = out.get("content", "")
    if isinstance(content, list):          # content parts: only text is served
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise _Bad(f"{where}.content", f"{where}.content: only text parts are served")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise _Bad(f"{where}.content", f"{where}.content: expected a string or a list of text parts")
    out["content"] = content
    return out


def _bad_list(where: str):
    raise _Bad(where, f"{where}: expected a list")


def _tool_call(where: str, c) -> dict:
    """An assistant message's tool call, its arguments decoded: chat templates render them
    from a dict (a JSON string would be written quoted), as vLLM passes them."""
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or c.get("type", "function") != "function" or not isinstance(c.get("id"), str) \
            or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
        raise _Bad(where, f"{where}: expected {{id, type: 'function', function: {{name, arguments: JSON string}}}}")
    try:
        args = json.loads(fn["arguments"])
    except ValueError as e:
        raise _Bad(f"{where}.function.arguments", f"{where}.function.arguments: not JSON: {e}") from None
    return {"id": c["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _tools(tools) -> tuple[dict, ...]:
    """`tools` as the template reads them; only function tools, and no `strict` (OpenAI's
    structured outputs constrain the decoding: the arguments would not be the policy's sample)."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise _Bad("tools", f"tools: expected a list of function tools, got {type(tools).__name__}")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _Bad(f"tools[{i}]", f"tools[{i}]: expected {{type: 'function', function: {{name, description, "
                       f"parameters}}}} (only function tools are served), got {json.dumps(t)[:200]}")
        if fn.get("strict"):
            raise _Bad(f"tools[{i}].function.strict", f"tools[{i}].function.strict: true is constrained decoding, "
                       "which samples away from the policy; not served", "unsupported_parameter")
        out.append({"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters")
                                                     if fn.get(k) is not None}})
    return tuple(out)


def _tool_choice(body: dict, tools: tuple[dict, ...]) -> tuple[str, str]:
    """(tool_choice, the function it names or ""). 'required' and a named function force
    a call by prefilling its opening (ChatRequest.tool_choice); parallel calls cannot be
    turned off (the model writes as many call blocks as it does)."""
    if body.get("parallel_tool_calls") not in (None, True):
        raise _Bad("parallel_tool_calls", "parallel_tool_calls: only true is served: every tool-call block the "
                   "model writes is returned (limiting them would need constrained decoding)", "unsupported_parameter")
    choice = body.get("tool_choice")
    if choice is None or choice in ("none", "auto"):
        return choice or "auto", ""
    named = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if choice != "required" and not (isinstance(named, dict) and isinstance(named.get("name"), str)):
        raise _Bad("tool_choice", f"tool_choice: expected 'none', 'auto', 'required' or {{type: 'function', "
                   f"function: {{name}}}}, got {json.dumps(choice)[:100]}")
    if not tools:
        raise _Bad("tool_choice", f"tool_choice: {json.dumps(choice)[:100]} is only allowed when tools are specified")
    names = [t["function"]["name"] for t in tools]
    if named is not None and named["name"] not in names:
        raise _Bad("tool_choice", f"tool_choice: function {named['name']!r} is not one of the tools {names}")
    return ("required", "") if named is None else ("function", named["name"])


def _max_tokens(body: dict, cap: int) -> int | None:
    """max_completion_tokens or max_tokens (the older name); cut to workflow.max_new_tokens,
    the run's budget of one reply (a reply cut there ends with finish_reason 'length')."""
    given = {k: body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None}
    for k, v in given.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise _Bad(k, f"{k}: expected an integer >= 1, got {v!r}")
    if len(set(given.values())) > 1:
        raise _Bad("max_tokens", f"max_tokens={given['max_tokens']} and max_completion_tokens="
                   f"{given['max_completion_tokens']} disagree: give one")
    return min(next(iter(given.values())), cap) if given else None


def _number(body: dict, key: str, lo: float, hi: float, open_lo: bool) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or not (lo < v if open_lo else lo <= v) or v > hi:
        note = " (a greedy reply is no sample of the policy: give a temperature > 0)" if key == "temperature" and v == 0 else ""
        raise _Bad(key, f"{key}: expected a number in {'(' if open_lo else '['}{lo}, {hi}], got {v!r}{note}")
    return float(v)


def _n(v) -> int:
    if v is None:
        return 1
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_N:
        raise _Bad("n", f"n: expected an integer in [1, {MAX_N}], got {v!r}")
    return v


def _stop(v) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise _Bad("stop", f"stop: expected a string or a list of at most {MAX_STOP} non-empty strings, got {v!r}")
    return tuple(stops)


def _no_stream(body: dict) -> None:
    if body.get("stream") not in (None, False):
        raise _Bad("stream", "stream: only stream=false is served", "unsupported_parameter")


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """`text` up to the first stop string (excluded, as OpenAI returns it) and whether one was
    found. The sample keeps every token the engine sampled (the trainer scores what was drawn)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


@dataclass(frozen=True)
class Choice:
    text: str | None
    """The message's content (None: only tool calls, as OpenAI sends it)."""
    finish_reason: str
    """'stop' (a stop token or stop string), 'length' (max_tokens or the context's end) or
    'tool_calls' (the reply called tools)."""
    prompt_tokens: int
    completion_tokens: int
    tool_calls: tuple[tuple[str, str, dict], ...] = ()
    """(id, name, arguments) of each tool call, in the reply's order."""

    def message(self) -> dict:
        msg = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            msg["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                                 for i, n, a in self.tool_calls]
        return msg


def completion(request_id: str, agent: str, choices: list[Choice]) -> dict:
    """The `chat.completion` object the client parses."""
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": agent,
        "choices": [{"index": i, "message": c.message(),
                     "finish_reason": c.finish_reason, "logprobs": None} for i, c in enumerate(choices)],
        "usage": {"prompt_tokens": choices[0].prompt_tokens,
                  "completion_tokens": sum(c.completion_tokens for c in choices),
                  "total_tokens": choices[0].prompt_tokens + sum(c.completion_tokens for c in choices)},
    }


def models(agents: list[str]) -> dict:
    """GET /v1/models: the agents."""
    return {"object": "list", "data": [{"id": a, "object": "model", "created": 0, "owned_by": "flexmarl"}
                                       for a in agents]}
