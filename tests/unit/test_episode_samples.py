"""Schema 6 (issue 41): each episode call's /samples row says whether its prompt was tokenised
fresh from a history (`retokenized`) and how many of its last prompt ids are a forced prefill
(`prefill_len`), decided in the episode layer (workflows/episode.py) and written through the
call -> node -> row path of a real EpisodeExperience and StoreFile."""
from __future__ import annotations

import h5py
import numpy as np

from flexmarl_hpc.analysis.load import load_run
from flexmarl_hpc.config.schema import Config, WorkflowConfig
from flexmarl_hpc.orchestrator.experience import EpisodeExperience
from flexmarl_hpc.store.tables import StoreFile
from flexmarl_hpc.workflows.chat import Conversation, SyntheticChatTokenizer
from flexmarl_hpc.workflows.episode import EpisodeRunner

TOK = SyntheticChatTokenizer()
Q = [{"role": "user", "content": "2+3?"}]
PREFILL = '<tool_call>\n{"name": "'


async def edits_its_history(ctx, example):
    """A call, one that continues it, one whose history the episode edited (not what was
    sampled), and a fresh one with a prefill."""
    r = await ctx.chat("solver", Q)
    await ctx.chat("solver", [*Q, r.message, {"role": "user", "content": "sure?"}])
    await ctx.chat("solver", [*Q, {"role": "assistant", "content": "5"}, {"role": "user", "content": "sure?"}])
    await ctx.chat("solver", Q, prefill=PREFILL)
    return {"solver": 1.0}


class Stream:
    def batch(self, step, n):
        return [(step * n + i, {}) for i in range(n)]


class Task:
    stop_tokens = frozenset(TOK.stop_ids)
    stream = Stream()

    def runner(self, cfg, tools=None, record_tool=None):
        return EpisodeRunner(edits_its_history, cfg.agent_names, cfg.run.seed, cfg.workflow.max_new_tokens,
                             lambda agent: Conversation(TOK), tools=tools, record_tool=record_tool)


def test_an_edited_history_and_a_prefill_are_said_by_their_sample_rows(tmp_path):
    cfg = Config(workflow=WorkflowConfig(episode="tests:edits_its_history", agents=["solver"], group_size=1,
                                         inputs_per_step=1, max_new_tokens=4))
    store = StoreFile(tmp_path / "s.h5", cfg.agent_names, {})
    exp = EpisodeExperience(cfg, Task(), store, tools=object())
    try:
        exp.admit_step(0)
        nodes = []
        while exp.pending["solver"]:                  # one call at a time: each answered "ab"
            (node,) = exp.pending["solver"]
            exp.take_pending("solver", {id(node)})
            exp.record_generation([(node, TOK.encode("ab") + [TOK.eos_id], [-0.5] * 3)], 0, 0)
            nodes.append(node)
        store.flush()
    finally:
        exp.runner.pool = None
        exp.close()
        store.close()
    assert [n.turn for n in nodes] == [0, 1, 2, 3]
    with h5py.File(tmp_path / "s.h5", "r") as f:
        rows = f["samples/solver"][:]
        toks = f["tokens/solver"]["token"]
        assert rows["retokenized"].tolist() == [0, 0, 1, 0]        # only the edited history
        n = len(TOK.encode(PREFILL))
        assert rows["prefill_len"].tolist() == [0, 0, 0, n] and n > 1
        last = rows[3]
        end = last["token_offset"] + last["prompt_len"]
        # the prompt's last prefill_len ids are the prefill's own: out of the sampled response
        assert toks[end - n:end].tolist() == TOK.encode(PREFILL)
        assert TOK.decode(toks[last["token_offset"]:end - n].tolist(), skip_special_tokens=False).endswith(
            "<|im_start|>assistant\n")
    run = load_run(tmp_path / "s.h5")
    assert run.samples["retokenized"].tolist() == [0, 0, 1, 0] and run.samples["prefill_len"].tolist() == [0, 0, 0, n]
    assert np.issubdtype(run.samples["prefill_len"].dtype, np.integer)


async def continues_twice(ctx, example):
    r = await ctx.chat("solver", Q)
    await ctx.chat("solver", [*Q, r.message, {"role": "user", "content": "sure?"}])
    return {"solver": 1.0}


def test_a_continued_conversation_its_template_renders_otherwise_is_flagged_too():
    """A template that renders past assistant turns otherwise than the last (as Qwen3 drops
    past thinking): the follow-up continues the thread by its messages, but its rendering no
    longer extends the ids, so it was encoded from text: retokenized."""
    from flexmarl_hpc.workflows.chat import CHATML, ChatTemplate
    tok = SyntheticChatTokenizer()
    tok.template = ChatTemplate(CHATML.replace("{{ m['content'] }}", "{{ m['content'] if loop.last or "
                                               "m['role'] != 'assistant' else '...' }}"), tok.template.special_tokens)
    runner = EpisodeRunner(continues_twice, ["solver"], 0, 4, lambda agent: Conversation(tok))
    runner.start(0, 0, 0, {})
    calls = []
    for _ in range(3):
        runner.step()
        for c in runner.take()[0]:
            calls.append(c)
            c.done(tok.encode("ab") + [tok.eos_id], frozenset(tok.stop_ids))
    runner.close()
    assert len(calls) == 2 and calls[1].thread is calls[0].thread and calls[1].thread.conv.rerendered == 1
    assert [c.retokenized for c in calls] == [False, True]
