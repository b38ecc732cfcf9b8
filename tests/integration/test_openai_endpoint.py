"""The OpenAI-compatible endpoint of workflow.agent (workflows/openai_api.py, openai_agent.py):
every refused request field is an OpenAI-style 400 naming it, an unknown model a 404 naming
the agents; and programs written against the official `openai` client (sync and async) run
in the worker pool, their completions become ctx.chat calls of the agent named as the model,
and a follow-up request continues the agent's conversation token for token. With `tools`,
the reply's tool calls come back as OpenAI `tool_calls`, run in the sandbox (/run_tools), and
the follow-up with the `tool` messages still continues the sampled ids, the results masked."""
from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import pytest

from flexmarl_hpc.config.plan import resolve
from flexmarl_hpc.config.schema import WorkflowConfig
from flexmarl_hpc.config.tools import ToolsConfig
from flexmarl_hpc.tools.pool import WorkerPool
from flexmarl_hpc.tools.registry import Tools
from flexmarl_hpc.workflows.chat import Conversation, SyntheticChatTokenizer
from flexmarl_hpc.workflows.openai_agent import agent_episode
from flexmarl_hpc.workflows.openai_api import REFUSED_WHY, ApiError, ChatRequest, parse_request
from tests.conftest import ROOT
from tests.helpers import answer_until_done, BLOCK, scripted_tool_use

AGENTS = ["writer", "critic"]
USER = [{"role": "user", "content": "2+3?"}]
CALC = {"type": "function", "function": {"name": "calculate", "parameters": {"type": "object"}}}
CALL = {"id": "writer-0-0", "type": "function", "function": {"name": "calculate", "arguments": '{"expression": "2+3"}'}}


def parse(**body):
    return parse_request({"model": "writer", "messages": USER, **body}, AGENTS, max_new_tokens=16)


@pytest.mark.parametrize("field,value", [(k, 1) for k in REFUSED_WHY] + [("bogus", 1), ("stream", True),
                                          ("temperature", 0), ("temperature", 2.5), ("top_p", 0), ("n", 0),
                                          ("max_tokens", 0), ("max_completion_tokens", "8"), ("stop", [1]),
                                          ("stop", ["a"] * 5), ("tools", [{"type": "function"}]),
                                          ("tools", [{"type": "web_search"}]), ("tools", CALC),
                                          ("tools", [{**CALC, "function": {**CALC["function"], "strict": True}}]),
                                          ("tool_choice", "required"), ("parallel_tool_calls", False),   # no tools
                                          ("tool_choice", {"type": "function", "function": {"name": "calculate"}}),
                                          ("tool_choice", {"type": "allowed_tools"}), ("tool_choice", "any"),
                                          ("messages", [{"role": "tool", "content": "5"}]),
                                          ("messages", [{"role": "user", "content": "x", "tool_calls": [CALL]}]),
                                          ("messages", [{"role": "assistant", "tool_calls": [
                                              {**CALL, "function": {"name": "calculate", "arguments": "{2+3"}}]}]),
                                          ("messages", []),
                                          ("messages", [{"role": "robot", "content": "x"}]),
                                          ("messages", [{"role": "user", "content": [{"type": "image_url"}]}])])
def test_each_refused_field_is_a_400_naming_it(field, value):
    err = parse(**{field: value})
    assert isinstance(err, ApiError) and err.status == 400, err
    assert (err.param or "").startswith(field) and field in err.message or err.param == field
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_a_forced_tool_choice_parses_and_one_naming_no_given_tool_is_a_400():
    named = {"type": "function", "function": {"name": "calculate"}}
    req = parse(tools=[CALC], tool_choice=named)
    assert (req.tool_choice, req.function, req.forced) == ("function", "calculate", True)
    req = parse(tools=[CALC], tool_choice="required")
    assert (req.tool_choice, req.function, req.forced) == ("required", "", True) and not parse(tools=[CALC]).forced
    err = parse(tools=[CALC], tool_choice={"type": "function", "function": {"name": "search"}})
    assert (err.status, err.param) == (400, "tool_choice") and "'search' is not one of the tools ['calculate']" \
        in err.message, err


def test_the_prefill_is_the_templates_own_call_opening_and_parses_once_completed(tiny_tok):
    from flexmarl_hpc.workflows.toolcalls import PREFILL, parse_hermes
    named, required = PREFILL["hermes"]("calculate"), PREFILL["hermes"](None)
    assert (named, required) == ('<tool_call>\n{"name": "calculate", "arguments": ', '<tool_call>\n{"name": "')
    # the tiny model's Qwen2.5-style template renders a call of `calculate` starting with it
    rendered = tiny_tok.render([*USER, {"role": "assistant", "content": "", "tool_calls": [
        {**CALL, "function": {"name": "calculate", "arguments": {"expression": "2+3"}}}]}], add_generation_prompt=False)
    assert named + '{"expression": "2+3"}}\n</tool_call>' in rendered and named.startswith(required)
    calls, errors = parse_hermes(named + '{"expression": "2+3"}}\n</tool_call>', "solver-0")
    assert [(c.name, c.arguments, c.id) for c in calls] == [("calculate", {"expression": "2+3"}, "solver-0-0")]
    calls, _ = parse_hermes(required + 'calculate", "arguments": {}}', "solver-0")     # cut: no closing tag
    assert [(c.name, c.arguments) for c in calls] == [("calculate", {})] and not errors
    assert parse_hermes(named + '{"expression": 2+3}', "s")[1]          # broken JSON: an error, no call


def test_an_unknown_model_is_a_404_naming_the_agents_and_served_fields_parse():
    err = parse_request({"model": "gpt-4o", "messages": USER}, AGENTS, 16)
    assert err.status == 404 and err.code == "model_not_found" and "['writer', 'critic']" in err.message
    req = parse(temperature=0.7, top_p=0.9, max_tokens=99, n=2, stop="\n", stream=False, tool_choice="none",
                user="me", messages=[{"role": "user", "content": [{"type": "text", "text": "2+3?"}]},
                                     {"role": "assistant", "content": "5", "refusal": None, "tool_calls": None}])
    assert req == ChatRequest("writer", [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}],
                              16, 0.7, 0.9, 2, ("\n",), tool_choice="none")   # max_tokens cut to workflow.max_new_tokens
    assert parse(max_tokens=4, max_completion_tokens=5).param == "max_tokens"
    # tools, and a conversation with a tool call and its result: the arguments decoded for the template
    req = parse(tools=[{**CALC, "function": {**CALC["function"], "strict": False}}], parallel_tool_calls=True,
                messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                          {"role": "tool", "tool_call_id": "writer-0-0", "content": [{"type": "text", "text": "5"}]}])
    assert req.tools == (CALC,) and req.tool_choice == "auto"
    assert req.messages[1:] == [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "writer-0-0", "type": "function", "function": {"name": "calculate", "arguments": {"expression": "2+3"}}}]},
        {"role": "tool", "tool_call_id": "writer-0-0", "content": "5"}]


# -- programs written against the official client (module level: the worker imports them) --
def writer_then_critic(base_url, example):
    import openai
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": example["question"]}]
    first = client.chat.completions.create(model="writer", messages=messages, max_tokens=2)
    messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "Again?"}]
    again = client.chat.completions.create(model="writer", messages=messages, stop=["b"])
    reviews = client.chat.completions.create(model="critic", messages=messages[:1], n=2, temperature=0.5)
    edited = [messages[0], {"role": "assistant", "content": "5"}, messages[-1]]      # not what was sampled
    client.chat.completions.create(model="writer", messages=edited, max_tokens=1)
    errors = []
    for bad in ({"model": "gpt-4o"}, {"model": "writer", "stream": False, "seed": 1}):
        try:
            client.chat.completions.create(messages=messages[:1], **bad)
        except (openai.NotFoundError, openai.BadRequestError) as e:
            errors.append((e.status_code, e.body["code"], e.body["param"]))
    assert errors == [(404, "model_not_found", "model"), (400, "unsupported_parameter", "seed")], errors
    assert [m.id for m in client.models.list()] == ["writer", "critic"]          # GET /v1/models
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 2, first
    assert again.choices[0].message.content == "a" and again.choices[0].finish_reason == "stop", again
    assert [c.message.content for c in reviews.choices] == ["ab", "ab"], reviews
    return {"writer": [1.0, 0.5, 0.0], "critic": 0.25}


async def async_program(base_url, example):
    import openai
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    r = await client.chat.completions.create(model="critic", messages=[{"role": "user", "content": "hi"}])
    await client.chat.completions.create(model="critic", max_tokens=1, messages=[      # an edited history
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "zz"}, {"role": "user", "content": "?"}])
    return None if r.choices[0].message.content == "ab" else {"critic": 0.0}


def sleeping_program(base_url, example):
    time.sleep(30)


def raising_program(base_url, example):
    raise KeyError("answer")


def refused_program(base_url, example):
    """Lets the client's BadRequestError out: an exception that does not unpickle (it needs
    its response), which once broke the worker pool and lost the program's traceback."""
    import openai
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    client.chat.completions.create(model="writer", messages=USER, seed=1)      # refused: 400


def transcript_reward(example, result, transcript):
    assert result is None and [(t["agent"], t["retokenized"]) for t in transcript] == \
        [("critic", False), ("critic", True)], transcript
    return {"critic": 0.75 if transcript[0]["reply"] == "ab" else 0.0}


TOOL_FN = {"calculate": "flexmarl_hpc.workflows.calculate_tool:calculate"}


@pytest.fixture(scope="module")
def pool():
    """One worker pool for the module's episodes: its forkserver starts once (~3 s). One
    worker: a program's tool calls (/run_tools) must run while the program holds it."""
    cfg = ToolsConfig(workers=1, functions=TOOL_FN)
    p = WorkerPool(Tools.from_config(cfg), cfg)
    yield p
    p.close()


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    """The tiny chat model's tokenizer and its Qwen2.5-style template (renders tools, tool calls
    and <tool_response> turns as Qwen2.5 does)."""
    from flexmarl_hpc.workflows.chat import ChatTokenizer
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_tiny_chat_model import write_tokenizer
    folder = tmp_path_factory.mktemp("tiny-chat")
    write_tokenizer(folder, 400)
    return ChatTokenizer(folder)


def answer_ab(tok, call):
    return tok.encode("ab") + [tok.eos_id]


def run_episode(pool, spec, reward="", timeout_s=60.0, tok=None, answer=answer_ab, agents=AGENTS, recorded=None,
                example=None):
    """One episode of `spec`; every call is answered `answer(tok, call)` ('a', 'b', <eos>), cut at
    its max_tokens; `recorded` gets the (tool, outcome) of each pool call."""
    tok = tok or SyntheticChatTokenizer()
    recorded = [] if recorded is None else recorded
    spec = spec if ":" in spec else f"{__name__}:{spec}"
    w = WorkflowConfig(agent=spec, reward=reward and f"{__name__}:{reward}", agents=agents,
                       agent_timeout_s=timeout_s)
    from flexmarl_hpc.config.tools import read_function
    from flexmarl_hpc.workflows.episode import EpisodeRunner
    runner = EpisodeRunner(agent_episode(w), agents, 0, 96, lambda a: Conversation(tok), {}, tools=pool,
                           user_tools={k: read_function(k, v) for k, v in TOOL_FN.items()},
                           record_tool=lambda ctx, name, outcome, s: recorded.append((name, outcome)))
    runner.start(0, 0, 0, example or {"question": "2+3?"})
    calls = []
    try:
        done = answer_until_done(runner, tok, answer, calls, 60)
        if done:
            return done[0], calls, tok
    finally:
        runner.pool = None             # the module's pool outlives the runner
        runner.close()
    raise AssertionError("the episode did not end")


def test_an_openai_program_runs_unchanged_and_its_follow_up_is_token_exact(pool):
    f, calls, tok = run_episode(pool, "writer_then_critic")
    assert f.failure is None, f.failure and f.failure.traceback
    assert f.rewards == {"writer": [1.0, 0.5, 0.0], "critic": 0.25}
    assert [(c.agent, c.index) for c in calls] == [("writer", 0), ("writer", 1), ("critic", 0), ("critic", 1),
                                                   ("writer", 2)]
    first, again = calls[0], calls[1]
    assert again.thread is first.thread          # the copied message_dump() continues the conversation
    # the follow-up's prompt is the first prompt and its sampled ids verbatim (cut by max_tokens:
    # no stop token), then the new turn
    assert again.prompt[:len(first.prompt) + 3] == first.prompt + tok.encode("ab") + [tok.eos_id]
    assert again.prompt == tok.encode(tok.render(
        [*USER, {"role": "assistant", "content": "ab"}, {"role": "user", "content": "Again?"}]))
    assert again.sampling is None and calls[2].sampling == (0.5, 1.0) and first.max_tokens == 2
    # the edited history: a conversation of its own, tokenised fresh from the text
    assert calls[4].thread not in (first.thread, calls[2].thread, calls[3].thread)
    assert calls[4].prompt == tok.encode(tok.render([*USER, {"role": "assistant", "content": "5"},
                                                     {"role": "user", "content": "Again?"}]))
    # ... and its sample says so (the episode layer's flag: /samples retokenized), the others not
    assert [c.retokenized for c in calls] == [False, False, False, False, True]


def test_an_async_program_with_a_reward_function_and_a_raising_program(pool):
    f, calls, _ = run_episode(pool, "async_program", reward="transcript_reward")
    assert f.failure is None and f.rewards == {"critic": 0.75}, f.failure
    f, calls, _ = run_episode(pool, "raising_program")
    assert f.failure.kind == "AgentProgramError" and "KeyError" in f.failure.message and not calls
    assert 'raise KeyError("answer")' in f.failure.traceback      # the program's own line
    f, _, _ = run_episode(pool, "refused_program")
    assert f.failure.kind == "AgentProgramError" and "BadRequestError" in f.failure.message, f.failure
    assert "messages=USER, seed=1)" in f.failure.traceback
    f, _, _ = run_episode(pool, "async_program")           # returns None and no workflow.reward
    assert f.failure.kind == "AgentProgramError" and "workflow.reward" in f.failure.message
    f, _, _ = run_episode(pool, "sleeping_program", timeout_s=1.0)      # its worker is killed
    assert f.failure.kind == "AgentTimeout" and "no result in 1.0 s" in f.failure.message, f.failure


def tool_program(base_url, example):
    """An OpenAI tool loop, its wire shapes checked: the call as `tool_calls` (an id, the
    arguments a JSON string), run by the endpoint's /run_tools, its result sent back."""
    import openai
    from flexmarl_hpc.workflows.openai_calculator import TOOLS, run_tools
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": example["question"]}]
    r = client.chat.completions.create(model="solver", messages=messages, tools=TOOLS, tool_choice="auto")
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None, r
    assert [(c.id, c.type, c.function.name, c.function.arguments) for c in msg.tool_calls] == \
        [("solver-0-0", "function", "calculate", '{"expression": "12 * 30"}')], msg
    results = run_tools(client, msg.tool_calls)
    assert [(m["tool_call_id"], m["content"]) for m in results] == [("solver-0-0", "360")], results
    messages += [msg.model_dump(), *results]
    final = client.chat.completions.create(model="solver", messages=messages, tools=TOOLS)
    assert final.choices[0].message.content == "The answer is 360" and not final.choices[0].message.tool_calls
    edited = json.loads(json.dumps(messages))
    edited[1]["tool_calls"][0]["function"]["arguments"] = '{"expression": "360"}'   # not what was sampled
    client.chat.completions.create(model="solver", messages=edited, tools=TOOLS)
    raw = client.chat.completions.create(model="solver", messages=messages[:1], tools=TOOLS, tool_choice="none")
    assert raw.choices[0].finish_reason == "stop" and raw.choices[0].message.content == BLOCK, raw
    try:
        client.chat.completions.create(model="solver", messages=messages[:1], tools=TOOLS, parallel_tool_calls=False)
        raise AssertionError("parallel_tool_calls=false was served")
    except openai.BadRequestError as e:
        assert e.body["param"] == "parallel_tool_calls", e.body
    return {"solver": 1.0}


def test_a_tool_using_program_gets_tool_calls_runs_them_in_the_sandbox_and_stays_token_exact(pool, tiny_tok):
    from flexmarl_hpc.runtime.microbatch import microbatch_from_arrays, pack_microbatch
    recorded = []
    f, calls, tok = run_episode(pool, "tool_program", tok=tiny_tok, answer=scripted_tool_use, agents=["solver"],
                                recorded=recorded, example={"question": "What is 12 * 30?"})
    assert f.failure is None, f.failure and f.failure.traceback
    first, follow, edited, raw = calls
    assert '"name": "calculate"' in tok.decode(first.prompt, skip_special_tokens=False)   # the tools rendered
    # the follow-up continues the sampled ids verbatim (the returned tool_calls message stood
    # for the reply as sampled), then the template's tool turn
    assert follow.thread is first.thread and follow.thread.conv.rerendered == 0
    assert follow.prompt[:len(first.prompt) + len(first.response)] == first.prompt + first.response
    rest = tok.decode(follow.prompt[len(first.prompt) + len(first.response):], skip_special_tokens=False)
    assert rest == "\n<|im_start|>user\n<tool_response>\n360\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert ("calculate", "ok") in recorded          # a user tool (tools.functions): run in the sandbox
    # the sample's loss mask (as rank 0 packs it) covers the sampled ids only, not the tool's result
    task = SimpleNamespace(vocab=SimpleNamespace(pad_id=0), allowed_tokens=lambda turn: None)
    node = SimpleNamespace(prompt=follow.prompt, response=follow.response, logprobs=[0.0] * len(follow.response),
                           turn=0, advantage=1.0, version=0, step=0)
    mb = microbatch_from_arrays(pack_microbatch([node], task))
    mask = mb.response_mask()[0]
    assert mb.input_ids[0][mask].tolist() == follow.response and not mask[:len(follow.prompt)].any()
    assert "<tool_response>\n360\n</tool_response>" in tok.decode(follow.prompt, skip_special_tokens=False)
    # an edited tool call is rendered by the template from its (decoded) arguments, encoded fresh
    assert edited.thread is not first.thread and edited.prompt == tok.encode(tok.render(
        [edited.messages[0], {"role": "assistant", "content": "", "tool_calls": [{"id": "solver-0-0", "type": "function",
         "function": {"name": "calculate", "arguments": {"expression": "360"}}}]}, edited.messages[2]],
        tools=first.tools))
    assert [c.retokenized for c in calls] == [False, False, True, False]     # its sample says so
    assert raw.tools == first.tools                 # tool_choice none: rendered, the reply left unparsed


NAMED = {"type": "function", "function": {"name": "calculate"}}


def forced_program(base_url, example):
    """tool_choice a named function, then 'required', then a 'required' reply the model
    does not complete: the 422 the client raises, naming tool_choice."""
    import openai
    from flexmarl_hpc.workflows.openai_calculator import TOOLS, run_tools
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": example["question"]}]
    r = client.chat.completions.create(model="solver", messages=messages, tools=TOOLS, tool_choice=NAMED)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None, r
    assert [(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls] == \
        [("solver-0-0", "calculate", '{"expression": "12 * 30"}')], msg
    messages += [msg.model_dump(), *run_tools(client, msg.tool_calls)]
    final = client.chat.completions.create(model="solver", messages=messages, tools=TOOLS)
    assert final.choices[0].message.content == "The answer is 360", final
    r = client.chat.completions.create(model="solver", messages=messages[:1], tools=TOOLS, tool_choice="required")
    assert [(c.id, c.function.name) for c in r.choices[0].message.tool_calls] == [("solver-2-0", "calculate")], r
    try:
        client.chat.completions.create(model="solver", messages=[{"role": "user", "content": "break"}], tools=TOOLS,
                                       tool_choice=NAMED)
        raise AssertionError("a reply that is no call was returned as one")
    except openai.UnprocessableEntityError as e:
        assert (e.status_code, e.body["param"], e.body["code"]) == (422, "tool_choice", "tool_choice_not_met"), e.body
        assert "'calculate'" in e.body["message"] and "oops" in e.body["message"], e.body
    return {"solver": [1.0, 1.0, 0.5, 0.0]}


def forced_answers(tok, call):
    """The rest of a forced call (sampled as single-byte tokens), the answer after a tool
    result, or no call at all for 'break'."""
    if call.messages[-1]["role"] == "tool":
        return tok.encode("The answer is 360") + [tok.eos_id]
    rest = {"break": "oops"}.get(call.messages[-1]["content"], '{"expression": "12 * 30"}}\n</tool_call>')
    if call.prefill.endswith('"name": "'):
        rest = 'calculate", "arguments": ' + rest
    return [i for ch in rest for i in tok.encode(ch)] + [tok.eos_id]


def test_a_forced_tool_call_is_prefilled_outside_the_mask_and_continued_token_exact(pool, tiny_tok):
    from flexmarl_hpc.runtime.microbatch import microbatch_from_arrays, pack_microbatch
    from flexmarl_hpc.workflows.openai_calculator import TOOLS
    f, calls, tok = run_episode(pool, "forced_program", tok=tiny_tok, answer=forced_answers, agents=["solver"],
                                example={"question": "What is 12 * 30?"})
    assert f.failure is None, f.failure and f.failure.traceback
    assert f.rewards == {"solver": [1.0, 1.0, 0.5, 0.0]}       # the unmet call is a sample of the episode too
    first, follow, required, unmet = calls
    prefill = '<tool_call>\n{"name": "calculate", "arguments": '
    assert (first.prefill, required.prefill, unmet.prefill, follow.prefill) == \
        (prefill, '<tool_call>\n{"name": "', prefill, "")
    # the prompt is the rendering with the call's opening after it: not sampled; its sample
    # counts the opening's ids (/samples prefill_len), the prompt's last ones ...
    assert first.prompt == tok.encode(tok.render(first.messages, tools=TOOLS)) + tok.encode(prefill)
    assert first.prefill_len == len(tok.encode(prefill)) > 1 and follow.prefill_len == 0
    assert required.prefill_len == len(tok.encode(required.prefill))
    assert tok.decode(first.response, skip_special_tokens=False) == '{"expression": "12 * 30"}}\n</tool_call><|im_end|>'
    # ... so out of the loss mask (as rank 0 packs the sample): the sampled ids alone are trained
    task = SimpleNamespace(vocab=SimpleNamespace(pad_id=0), allowed_tokens=lambda turn: None)
    for c in (first, follow):
        node = SimpleNamespace(prompt=c.prompt, response=c.response, logprobs=[0.0] * len(c.response),
                               turn=0, advantage=1.0, version=0, step=0)
        mb = microbatch_from_arrays(pack_microbatch([node], task))
        mask = mb.response_mask()[0]
        assert mb.input_ids[0][mask].tolist() == c.response and not mask[:len(c.prompt)].any()
    assert not any(c.retokenized for c in calls)
    # the follow-up continues the prefilled and sampled ids verbatim: one conversation, no re-tokenising
    assert follow.thread is first.thread and follow.thread.conv.rerendered == 0
    assert follow.prompt[:len(first.prompt) + len(first.response)] == first.prompt + first.response


def test_the_tool_example_trains_its_solver_against_the_endpoint(pool, tiny_tok):
    recorded = []
    f, calls, _ = run_episode(pool, "flexmarl_hpc.workflows.openai_calculator:main", tok=tiny_tok,
                              answer=scripted_tool_use, agents=["solver"], recorded=recorded,
                              example={"question": "What is 12 * 30?", "answer": 360})
    assert f.failure is None and f.rewards == {"solver": 1.0}, f.failure and f.failure.traceback
    assert len(calls) == 2 and calls[1].thread is calls[0].thread and ("calculate", "ok") in recorded
    assert calls[0].prefill == '<tool_call>\n{"name": "calculate", "arguments": ' and not calls[1].prefill


def test_a_programs_tool_calls_on_tool_ranks_take_no_slot_there_or_here():
    """tools.ranks > 0: rank 0's RemotePool sends a lent call although every slot is held (the
    programs waiting on their tools hold them), and the tool rank runs it lent too."""
    import asyncio
    from flexmarl_hpc.ranks.tool_ranks import RemotePool, _answer
    from flexmarl_hpc.runtime import messages
    from flexmarl_hpc.tools.registry import ToolCall

    class Comm:
        sent: list = []

        def isend(self, wire, dest, tag):
            self.sent.append(messages.decode(wire))
            return SimpleNamespace(Test=lambda: True)

        def Iprobe(self, source=None, tag=None, status=None):
            return False                                     # no answer comes: the call times out

    async def all_slots_held():
        pool = RemotePool(Comm(), [3], ToolsConfig(workers=1, wall_s=0.05), grace_s=0.0)
        pool._free = asyncio.Semaphore(1)
        await pool._free.acquire()                           # the one slot: a program's
        lent = await asyncio.wait_for(pool.tool("calculate", "{}", lent=True), 2.0)
        with pytest.raises(asyncio.TimeoutError):            # not lent: it would wait for the slot
            await asyncio.wait_for(pool.tool("calculate", "{}"), 0.3)
        return lent

    assert asyncio.run(all_slots_held()).outcome == "timeout"
    assert Comm.sent == [messages.ToolRequest(0, "calculate", "{}", True)]
    seen = []

    class RankPool:
        async def tool(self, name, argument, lent=False):
            seen.append(lent)
            return ToolCall(name, "5", "ok", 0.0)

    asyncio.run(_answer(Comm(), 0, RankPool(), Comm.sent[0], []))
    assert seen == [True] and Comm.sent[-1] == messages.ToolDone(0, "5", "ok", 0.0)


def eval_program(base_url, example):
    import openai
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    r = client.chat.completions.create(model="writer", messages=[{"role": "user", "content": example["question"]}],
                                       temperature=0.7)
    return {"writer": 1.0 if r.choices[0].message.content == "ab" else 0.0}


def test_held_out_evaluation_runs_the_program_greedy_and_averages_its_rewards(pool):
    """run.eval_every with workflow.agent: the evaluator's episodes are the program's, each
    agent's reward is the metric (`<agent>_reward`: the program cannot set ctx.metrics)."""
    from flexmarl_hpc.config.schema import Config, RunConfig
    from flexmarl_hpc.orchestrator.episode_eval import EpisodeEvaluator
    from flexmarl_hpc.workflows.episode import EpisodeRunner
    tok = SyntheticChatTokenizer()
    cfg = Config(run=RunConfig(steps=1, eval_every=1, eval_inputs=2),
                 workflow=WorkflowConfig(agent=f"{__name__}:eval_program", agents=AGENTS, max_new_tokens=8))
    task = SimpleNamespace(stop_tokens=frozenset(tok.stop_ids), stream=SimpleNamespace(
        heldout=lambda n: [{"question": f"q{i}"} for i in range(n)]))
    runner = EpisodeRunner(agent_episode(cfg.workflow), AGENTS, 0, 8, lambda a: Conversation(tok), tools=pool)
    ev = EpisodeEvaluator(cfg, task, set(), {"writer": 0, "critic": 0}, runner)
    results, t0 = [], time.time()
    try:
        while not results and time.time() - t0 < 30:
            ev.start({"writer": 0, "critic": 0}, 1.0)     # steps the episodes, as the dispatcher does
            calls = ev.ready("writer", 0)
            if calls:
                assert all(len(ev.request(c)) == 5 and c.call.sampling == (0.7, 1.0) for c in calls)   # greedy
                ev.take(calls)
                ev.record(calls, [tok.encode("ab" if c.example == 0 else "zz") + [tok.eos_id] for c in calls], 0, 2.0)
            results = ev.take_results()
            time.sleep(0.01)
    finally:
        runner.pool = None
        ev.close()
    assert [(r.point, r.summary) for r in results] == [(0, {"task/writer_reward": 0.5, "task/episodes_failed": 0.0})]


def test_the_program_is_checked_before_launch_in_a_child():
    from flexmarl_hpc.config.schema import ConfigError
    from flexmarl_hpc.workflows.episode_check import check_episode
    check_episode("os.path:join", {}, field="workflow.agent")          # (a, *p): takes two arguments
    with pytest.raises(ConfigError, match=r"^workflow.agent: 'json:dumps' is not a function taking "
                                          r"\(base_url, example\)$"):
        check_episode("json:dumps", {}, field="workflow.agent")
    with pytest.raises(ConfigError, match=r"^workflow.reward: importing 'no_such_module' raised ModuleNotFoundError"):
        check_episode("no_such_module:reward", {}, field="workflow.reward")


def test_tool_ranks_are_allowed_with_an_openai_program():
    """Its programs run on the tool ranks and reach the endpoint through their rank's relay
    (tests/mpi/test_tools_mpi.py runs one); this was refused while only loopback served."""
    from flexmarl_hpc.config.load import load_config
    cfg = load_config("configs/openai_calculator.yaml", ["model.checkpoint=", "tools.ranks=1"])
    assert cfg.tools.ranks == 1 and cfg.workflow.agent.endswith("openai_calculator:main")


def test_the_simulator_refuses_an_openai_program_by_name(tmp_path):
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.sim.driver import simulate_run
    cfg = load_config("configs/openai_writer_critic.yaml", ["model.checkpoint="])
    with pytest.raises(ValueError, match=r"^workflow.agent: an `openai` program is not simulated"):
        simulate_run(resolve(cfg), None, tmp_path, "npu64_a3")
