"""Structured tool calls (issue 40): schemas through the chat template, Hermes/Qwen
`<tool_call>` blocks parsed into typed calls (a bad block is reported, not raised), results
back as `tool` messages token for token, and a user's function run in the sandbox.

    pytest -q tests/unit/test_tool_calls.py

The tokenizer is the tiny chat model's (scripts/make_tiny_chat_model.py: its tokenizer.json
and its Qwen2.5-style template), so no model or download is needed.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.config.tools import ToolsConfig
from flexmarl_hpc.config.tools import read_function
from flexmarl_hpc.tools.functions import BUILTIN_SCHEMAS
from flexmarl_hpc.tools.pool import WorkerPool
from flexmarl_hpc.tools.registry import Tools
from flexmarl_hpc.workflows.chat import ChatTemplate, ChatTokenizer, Conversation
from flexmarl_hpc.workflows.episode import EpisodeRunner
from flexmarl_hpc.workflows.toolcalls import ToolRequest, parse_hermes, parser_for
from tests.conftest import ROOT

USER_TOOL = '''
import os


def lookup(city: str, year: int = 2026):
    """Population of a city.

    More words."""
    print("noise on stdout")       # not the output
    return {"city": city, "year": year, "secret": os.environ.get("FLEXMARL_TEST_SECRET"), "uid": os.getuid()}
'''


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory) -> ChatTokenizer:
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_tiny_chat_model import write_tokenizer
    folder = tmp_path_factory.mktemp("tiny-chat")
    write_tokenizer(folder, 400)
    return ChatTokenizer(folder)


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    (tmp_path / "my_user_tools.py").write_text(USER_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_user_tools:lookup"


def test_hermes_blocks_parse_into_typed_calls_and_bad_ones_into_errors():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * 4"}}\n</tool_call>'
            '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expr</tool_call>'
            '<tool_call>["calculator"]</tool_call><tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>{"name": "x", "arguments": [1]}</tool_call><tool_call>{"name": "cut", "arguments": {}}')
    calls, errors = parse_hermes(text, "solver-3")
    assert calls == [ToolRequest("calculator", {"expression": "3 * 4"}, "solver-3-0"),
                     ToolRequest("python", {"code": "print(1)"}, "solver-3-1"),
                     ToolRequest("cut", {}, "solver-3-6")]          # a reply cut inside its last block
    assert [(e.id, e.error.split(":")[0]) for e in errors] == [
        ("solver-3-2", "invalid JSON"), ("solver-3-3", "expected a JSON object, got list"),
        ("solver-3-4", "expected a string 'name'"), ("solver-3-5", "expected 'arguments' to be an object, got list")]
    assert parse_hermes("no tools here") == ([], [])
    with pytest.raises(ValueError, match=r"tool-call format 'mistral': expected one of \['hermes'\]"):
        parser_for("mistral")


def test_a_template_without_tools_gets_them_in_its_system_message_as_qwen_writes_them(tiny_tok):
    """SmolLM2's template ignores `tools`; the tools then go into the system message in the
    form Qwen2.5's template writes (the form the hermes parser reads)."""
    qwen = ChatTemplate((ROOT / "tests/unit/fixtures/chat_templates/qwen2.jinja").read_text())
    smol = ChatTemplate((ROOT / "tests/unit/fixtures/chat_templates/smollm2.jinja").read_text())
    assert qwen.reads_tools and not smol.reads_tools and tiny_tok.template.reads_tools
    tools = [BUILTIN_SCHEMAS["calculator"]]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    assert smol.render(chat, True, tools=tools) == qwen.render(chat, True, tools=tools)
    assert tiny_tok.render(chat, tools=tools) == qwen.render(chat, True, tools=tools)
    assert "calculator" not in smol.render(chat, True)


def drive(runner: EpisodeRunner, sample) -> tuple[list, object]:
    """Run one episode, answering each call with the ids `sample(call)` gives."""
    runner.start(0, 0, 0, {"question": "What is 12 * 30?"})
    seen = []
    try:
        while True:
            runner.step()
            calls, done = runner.take()
            for c in calls:
                ids = sample(c)
                seen.append((c, list(c.prompt), ids))
                c.done(ids, frozenset(runner.stop_ids))
            if done:
                return seen, done[0]
            if not calls:
                runner.loop.run_until_complete(__import__("asyncio").sleep(0.01))
    finally:
        runner.close()


async def tool_episode(ctx, example):
    msgs = [{"role": "user", "content": example["question"]}]
    tools = [ctx.tool_schema("calculator"), ctx.tool_schema("lookup")]
    r = await ctx.chat("solver", msgs, tools=tools)
    results = await ctx.run_tools(r)
    ctx.metrics["results"] = results
    ctx.metrics["calls"] = r.tool_calls
    r2 = await ctx.chat("solver", msgs + [r.message, *results], tools=tools)
    return {"solver": float(len(r2.ids))}


def test_a_tool_using_episode_is_token_exact_and_runs_user_tools_in_the_sandbox(tiny_tok, user_module, monkeypatch):
    """The reply is sampled as single-byte tokens, ids the tokenizer never produces for this
    text (it merges them): the next prompt must hold them verbatim, then the tool results."""
    monkeypatch.setenv("FLEXMARL_TEST_SECRET", "host-only")
    cfg = ToolsConfig(functions={"lookup": user_module})
    text = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 30"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "lookup", "arguments": {"city": "Oslo"}}\n</tool_call>')
    as_bytes = [i for ch in text for i in tiny_tok.encode(ch)]
    assert as_bytes != tiny_tok.encode(text)                      # so reusing ids is a real check
    convs = []

    def new_conv(agent):
        convs.append(Conversation(tiny_tok))
        return convs[-1]

    runner = EpisodeRunner(tool_episode, ["solver"], 0, 400, new_conv,
                           tools=WorkerPool(Tools.from_config(cfg), cfg),
                           user_tools={"lookup": read_function("lookup", user_module)})
    runner.stop_ids = tiny_tok.stop_ids
    seen, fin = drive(runner, lambda c: as_bytes + [tiny_tok.eos_id] if c.index == 0 else tiny_tok.encode("Answer: 360<|im_end|>"))
    assert fin.failure is None, fin.error
    (c0, p0, s0), (c1, p1, s1) = seen
    assert p1[:len(p0) + len(s0)] == p0 + s0 and convs[0].rerendered == 0      # token-exact
    assert [c.name for c in fin.ctx.metrics["calls"]] == ["calculator", "lookup"]
    results = fin.ctx.metrics["results"]
    assert results[0] == {"role": "tool", "tool_call_id": "solver-0-0", "name": "calculator", "content": "360"}
    value = json.loads(results[1]["content"])
    assert value["city"] == "Oslo" and value["year"] == 2026
    assert value["secret"] is None                                # not this process: the sandbox's env
    if os.geteuid() == 0:
        assert value["uid"] == cfg.uid
    rest = tiny_tok.decode(p1[len(p0) + len(s0):], skip_special_tokens=False)
    assert rest.startswith("\n<|im_start|>user\n<tool_response>\n360\n</tool_response>\n<tool_response>\n{")
    assert '"name": "lookup"' in tiny_tok.decode(p0, skip_special_tokens=False)   # the schemas were rendered


def test_user_tool_schemas_come_from_the_signature_and_bad_registrations_are_one_line(user_module):
    spec = read_function("lookup", user_module)
    assert spec.schema["function"] == {"name": "lookup", "description": "Population of a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
        "required": ["city"]}}
    for functions, says in (({"lookup": "my_user_tools:nope"}, "has no module-level `def nope`"),
                            ({"lookup": "no_such_module_x:f"}, "no Python file for module 'no_such_module_x'"),
                            ({"calculator": user_module}, "shadows a built-in tool"),
                            ({"lookup": "just_a_name"}, "expected 'module:function'")):
        with pytest.raises(ConfigError, match=r"^tools\.functions"):
            ToolsConfig(functions=functions)
        try:
            ToolsConfig(functions=functions)
        except ConfigError as e:
            assert says in str(e) and "\n" not in str(e)


def test_arguments_that_do_not_fit_the_tool_are_refused_to_the_model(tiny_tok, user_module):
    cfg = ToolsConfig(functions={"lookup": user_module})
    recorded = []

    async def episode(ctx, example):
        r = await ctx.chat("solver", [{"role": "user", "content": "x"}], tools=[ctx.tool_schema("lookup")])
        ctx.metrics["results"] = await ctx.run_tools(r)
        return {"solver": 0.0}

    text = ('<tool_call>{"name": "calculator", "arguments": {"code": "1"}}</tool_call>'
            '<tool_call>{"name": "lookup", "arguments": {"town": "Oslo"}}</tool_call>'
            '<tool_call>{"name": "rm", "arguments": {}}</tool_call>')
    runner = EpisodeRunner(episode, ["solver"], 0, 400, lambda a: Conversation(tiny_tok),
                           tools=WorkerPool(Tools.from_config(cfg), cfg), record_tool=lambda *a: recorded.append(a[1:3]),
                           user_tools={"lookup": read_function("lookup", user_module)})
    runner.stop_ids = tiny_tok.stop_ids
    _, fin = drive(runner, lambda c: tiny_tok.encode(text) + [tiny_tok.eos_id])
    assert fin.failure is None, fin.error
    out = [m["content"] for m in fin.ctx.metrics["results"]]
    assert out[0].startswith("error: calculator: expected arguments {'expression': string}")
    assert out[1] == "error: lookup: unknown arguments ['town'], missing ['city']"
    assert out[2].startswith("error: unknown tool 'rm'")
    assert recorded == [("calculator", "refused"), ("lookup", "refused"), ("rm", "refused")]


def test_an_unknown_tool_format_is_refused_by_name_at_config_load():
    from flexmarl_hpc.config.load import load_config
    base = [f"{ROOT}/configs/math_team.yaml", "model.checkpoint=", "workflow.dataset.train=", "workflow.dataset.eval="]
    with pytest.raises(ConfigError, match=r"workflow\.tool_formats\.solver: expected one of \['hermes'\], got 'mistral'"):
        load_config(base[0], base[1:] + ["workflow.tool_formats.solver=mistral"])
    with pytest.raises(ConfigError, match=r"workflow\.tool_formats\.critic: expected an agent of"):
        load_config(base[0], base[1:] + ["workflow.tool_formats.critic=hermes"])
