"""`analyze --transcripts` (issue 40): the episodes of a real store printed as conversations,
decoded with the run's tokenizer (here the synthetic one: the run had no checkpoint): each
call's prompt (a continued conversation shows only what was added), reply, tool calls, the
tools that ran, reward and advantage, and why an episode failed; --html writes the same as a page.

The store is written by the orchestrator's EpisodeExperience with a real tool pool (the
calculator); the replies come from the test."""
from __future__ import annotations

import time

import yaml

from flexmarl_hpc.analyze import main as analyze
from flexmarl_hpc.config.load import to_dict
from flexmarl_hpc.config.schema import Config, WorkflowConfig
from flexmarl_hpc.orchestrator.experience import EpisodeExperience
from flexmarl_hpc.store.tables import StoreFile
from flexmarl_hpc.workflows.chat import Conversation, SyntheticChatTokenizer
from flexmarl_hpc.workflows.episode import EpisodeRunner

TOK = SyntheticChatTokenizer()
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 30"}}\n</tool_call>'


async def episode(ctx, example):
    msgs = [{"role": "user", "content": f"What is {example['q']}?"}]
    tools = [ctx.tool_schema("calculator")]
    r = await ctx.chat("solver", msgs, tools=tools)
    if ctx.episode == 1:
        return {"solver": example["no_such_key"]}
    msgs += [r.message, *await ctx.run_tools(r)]
    await ctx.chat("solver", msgs, tools=tools)
    return {"solver": [0.0, 1.0]}


class Task:
    stop_tokens = frozenset(TOK.stop_ids)

    class stream:
        @staticmethod
        def batch(step, n):
            return [(step * n + i, {"q": "12 * 30"}) for i in range(n)]

    def runner(self, cfg, tools=None, record_tool=None):
        return EpisodeRunner(episode, cfg.agent_names, cfg.run.seed, cfg.workflow.max_new_tokens,
                             lambda agent: Conversation(TOK), tools=tools, record_tool=record_tool)


def write_run(path):
    cfg = Config(workflow=WorkflowConfig(episode="tests.unit.test_transcripts:episode", agents=["solver"],
                                         group_size=2, inputs_per_step=1, max_new_tokens=200))
    store = StoreFile(path, cfg.agent_names, {"config_yaml": yaml.safe_dump(to_dict(cfg))})
    exp = EpisodeExperience(cfg, Task(), store)
    exp.admit_step(0)
    t0 = time.time()
    while exp.runner.running and time.time() - t0 < 30:
        exp.poll()
        calls = list(exp.pending["solver"])
        if not calls:
            time.sleep(0.01)                     # a calculator call on the pool's thread
            continue
        exp.take_pending("solver", {id(n) for n in calls})
        text = lambda n: CALL if n.turn == 0 else "So Answer: 360"      # noqa: E731
        exp.record_generation([(n, TOK.encode(text(n)) + [TOK.eos_id], [-0.5] * (len(text(n)) + 1))
                               for n in calls], 0, 0)
    exp.close()
    store.close()


def test_transcripts_show_prompts_replies_tool_calls_rewards_and_failures(tmp_path, capsys):
    write_run(tmp_path / "r.h5")
    page = tmp_path / "t.html"
    assert analyze([str(tmp_path / "r.h5"), "--transcripts", "--html", str(page)]) == 0
    out = capsys.readouterr().out
    first, failed = out.split("== step 0, example 0, episode 1")
    assert first.startswith("== step 0, example 0, episode 0  (mean reward: solver 0.500)")
    assert "-- solver call 0  reward 0.000  advantage" in first and "-- solver call 1  reward 1.000" in first
    assert "What is 12 * 30?" in first and '"name": "calculator"' in first      # prompt, tools in it
    assert "tool call solver-0-0: calculator {'expression': '12 * 30'}" in first
    added = first.split("prompt (continues solver call 0; added):")[1].split("reply:")[0]
    assert "<|im_start|>tool\n      360<|im_end|>" in added and "What is" not in added   # only the new part
    assert "So Answer: 360" in first and "ran: calculator (solver) ok in" in first
    assert "FAILED KeyError: 'no_such_key'" in failed
    assert "&lt;tool_call&gt;" in page.read_text() and "failed: KeyError" in page.read_text()
    assert analyze([str(tmp_path / "r.h5"), "--transcripts", "--worst", "1"]) == 0
    worst = capsys.readouterr().out
    assert worst.startswith("== step 0, example 0, episode 1") and "episode 0" not in worst
    assert analyze([str(tmp_path / "r.h5"), "--transcripts", "--agent", "critic"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--agent 'critic': expected one of ['solver']" in err
