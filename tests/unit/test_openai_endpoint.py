"""The OpenAI-compatible endpoint of workflow.agent (workflows/openai_api.py, openai_agent.py):
every refused request field is an OpenAI-style 400 naming it, an unknown model a 404 naming
the agents; and programs written against the official `openai` client (sync and async) run
in the worker pool, their completions become ctx.chat calls of the agent named as the model,
and a follow-up request continues the agent's conversation token for token."""
from __future__ import annotations

import time

import pytest

from flexmarl_hpc.config.schema import WorkflowConfig
from flexmarl_hpc.config.tools import ToolsConfig
from flexmarl_hpc.tools.pool import WorkerPool
from flexmarl_hpc.tools.registry import Tools
from flexmarl_hpc.workflows.chat import Conversation, SyntheticChatTokenizer
from flexmarl_hpc.workflows.openai_agent import agent_episode
from flexmarl_hpc.workflows.openai_api import REFUSED_WHY, ApiError, ChatRequest, parse_request

AGENTS = ["writer", "critic"]
USER = [{"role": "user", "content": "2+3?"}]


def parse(**body):
    return parse_request({"model": "writer", "messages": USER, **body}, AGENTS, max_new_tokens=16)


@pytest.mark.parametrize("field,value", [(k, 1) for k in REFUSED_WHY] + [("bogus", 1), ("stream", True),
                                          ("temperature", 0), ("temperature", 2.5), ("top_p", 0), ("n", 0),
                                          ("max_tokens", 0), ("max_completion_tokens", "8"), ("stop", [1]),
                                          ("stop", ["a"] * 5), ("tools", [{"type": "function"}]),
                                          ("tool_choice", "required"), ("messages", []),
                                          ("messages", [{"role": "robot", "content": "x"}]),
                                          ("messages", [{"role": "user", "content": [{"type": "image_url"}]}])])
def test_each_refused_field_is_a_400_naming_it(field, value):
    err = parse(**{field: value})
    assert isinstance(err, ApiError) and err.status == 400, err
    assert (err.param or "").startswith(field) and field in err.message or err.param == field
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_an_unknown_model_is_a_404_naming_the_agents_and_served_fields_parse():
    err = parse_request({"model": "gpt-4o", "messages": USER}, AGENTS, 16)
    assert err.status == 404 and err.code == "model_not_found" and "['writer', 'critic']" in err.message
    req = parse(temperature=0.7, top_p=0.9, max_tokens=99, n=2, stop="\n", stream=False, tool_choice="none",
                user="me", messages=[{"role": "user", "content": [{"type": "text", "text": "2+3?"}]},
                                     {"role": "assistant", "content": "5", "refusal": None, "tool_calls": None}])
    assert req == ChatRequest("writer", [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}],
                              16, 0.7, 0.9, 2, ("\n",))         # max_tokens cut to workflow.max_new_tokens
    assert parse(max_tokens=4, max_completion_tokens=5).param == "max_tokens"


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


def transcript_reward(example, result, transcript):
    assert result is None and [(t["agent"], t["retokenized"]) for t in transcript] == \
        [("critic", False), ("critic", True)], transcript
    return {"critic": 0.75 if transcript[0]["reply"] == "ab" else 0.0}


@pytest.fixture(scope="module")
def pool():
    """One worker pool for the module's episodes: its forkserver starts once (~3 s)."""
    cfg = ToolsConfig(workers=1)
    p = WorkerPool(Tools.from_config(cfg), cfg)
    yield p
    p.close()


def run_episode(pool, spec, reward="", timeout_s=60.0):
    """One episode of `spec`; every call is answered 'a', 'b', <eos> (cut at its max_tokens)."""
    tok = SyntheticChatTokenizer()
    w = WorkflowConfig(agent=f"{__name__}:{spec}", reward=reward and f"{__name__}:{reward}", agents=AGENTS,
                       agent_timeout_s=timeout_s)
    from flexmarl_hpc.workflows.episode import EpisodeRunner
    runner = EpisodeRunner(agent_episode(w), AGENTS, 0, 16, lambda a: Conversation(tok), {}, tools=pool)
    runner.start(0, 0, 0, {"question": "2+3?"})
    calls, t0 = [], time.time()
    try:
        while runner.running and time.time() - t0 < 60:
            runner.step()
            new, done = runner.take()
            for c in new:
                calls.append(c)
                c.done((tok.encode("ab") + [tok.eos_id])[:c.max_tokens], frozenset(tok.stop_ids))
            if done:
                return done[0], calls, tok
            time.sleep(0.002)
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


def test_an_async_program_with_a_reward_function_and_a_raising_program(pool):
    f, calls, _ = run_episode(pool, "async_program", reward="transcript_reward")
    assert f.failure is None and f.rewards == {"critic": 0.75}, f.failure
    f, calls, _ = run_episode(pool, "raising_program")
    assert f.failure.kind == "AgentProgramError" and "KeyError" in f.failure.message and not calls
    assert 'raise KeyError("answer")' in f.failure.traceback      # the program's own line
    f, _, _ = run_episode(pool, "async_program")           # returns None and no workflow.reward
    assert f.failure.kind == "AgentProgramError" and "workflow.reward" in f.failure.message
    f, _, _ = run_episode(pool, "sleeping_program", timeout_s=1.0)      # its worker is killed
    assert f.failure.kind == "AgentTimeout" and "no result in 1.0 s" in f.failure.message, f.failure


def test_the_program_is_checked_before_launch_in_a_child():
    from flexmarl_hpc.config.schema import ConfigError
    from flexmarl_hpc.workflows.episode_check import check_episode
    check_episode("os.path:join", {}, field="workflow.agent")          # (a, *p): takes two arguments
    with pytest.raises(ConfigError, match=r"^workflow.agent: 'json:dumps' is not a function taking "
                                          r"\(base_url, example\)$"):
        check_episode("json:dumps", {}, field="workflow.agent")
    with pytest.raises(ConfigError, match=r"^workflow.reward: importing 'no_such_module' raised ModuleNotFoundError"):
        check_episode("no_such_module:reward", {}, field="workflow.reward")


def test_the_simulator_refuses_an_openai_program_by_name(tmp_path):
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.sim.driver import simulate_run
    cfg = load_config("configs/openai_writer_critic.yaml", ["model.checkpoint="])
    with pytest.raises(ValueError, match=r"^workflow.agent: an `openai` program is not simulated"):
        simulate_run(cfg, None, tmp_path, "npu64_a3")
