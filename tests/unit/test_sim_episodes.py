"""Episode workflows in the simulator: the paper's text episode (workflows/paper_text.py) run
by the real orchestrator over synthetic workers, with the synthetic ChatML tokenizer of
random-init models (workflows/chat.py)."""
from __future__ import annotations

import dataclasses

import json
import types
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from flexmarl_hpc.config.plan import resolve
from flexmarl_hpc.config.load import load_plan
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.config.hf_config import ModelArgs
from flexmarl_hpc.sim.driver import cost_model, simulate_run
from flexmarl_hpc.sim.hardware import load_hardware
from flexmarl_hpc.workflows.chat import Conversation, SyntheticChatTokenizer
from flexmarl_hpc.sim.workload import EPISODE_ARGS, MA
from flexmarl_hpc.workflows.paper_text import DEFAULTS, call_counts
from tests.helpers import check_exactly_once

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ["a", "b", "c"]


def config(tmp_path, calls, steps=3, **args):
    raw = {"run": {"name": "ptext", "mode": "flex", "steps": steps, "checkpoint_every": 0,
                   "output_dir": str(tmp_path / "run")},
           "workflow": {"episode": "flexmarl_hpc.workflows.paper_text:episode", "agents": AGENTS,
                        "group_size": 4, "inputs_per_step": 2, "max_new_tokens": 512,
                        "episode_args": {"prompt_tokens": 128, "length_median": 96, "calls": calls, **args},
                        "dataset": {"train": str(ROOT / "data/paper_text/train.jsonl")}},
           "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 4,
                     "intermediate_size": 128, "max_seq_len": 4096},
           "rollout": {"replicas": 2}, "trainer": {"ranks_per_group": 1}}
    path = tmp_path / "ptext.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path)


def simulate(tmp_path, cfg):
    """The synthetic workers, priced on the lengths the episode asked for (work=None)."""
    hw = load_hardware("npu64_a3")
    path, _ = simulate_run(resolve(cfg), cost_model(resolve(cfg), hw), tmp_path / "sim", hw.name, None)
    return path


def expected_calls(cfg, input_id: int, traj: int) -> list[int]:
    """The episode's own draw of its call counts (ctx.rng is seeded by run, example, episode)."""
    ctx = types.SimpleNamespace(rng=np.random.default_rng([cfg.run.seed, input_id, traj]))
    counts = call_counts(ctx, AGENTS, cfg.workflow.episode_args["calls"])
    return [counts[a] for a in AGENTS]


def test_every_call_is_trained_once_and_the_stored_calls_are_the_episodes(tmp_path):
    cfg = config(tmp_path, {"b": [1, 4], "c": [1, 2]})
    path = simulate(tmp_path, cfg)
    check_exactly_once(path, 3)
    with h5py.File(path, "r") as f:
        ep = f["episodes"][:]
        assert len(ep) == 3 * 2 * 4                               # steps x examples x group
        for row in ep:
            assert row["calls"].tolist() == expected_calls(cfg, int(row["input_id"]), int(row["traj"]))
        for i, agent in enumerate(AGENTS):                       # one /samples row per call
            assert len(f[f"samples/{agent}"]) == int(ep["calls"][:, i].sum())
        assert len(set(map(tuple, ep["calls"].tolist()))) > 1     # the counts vary between episodes


def test_request_counts_follow_the_episodes_skew(tmp_path, monkeypatch):
    from flexmarl_hpc.sim import transport
    asked: dict[str, int] = {}
    real = transport.SyntheticWorkers.generate

    def counting(self, cmd):
        asked[cmd.agent] = asked.get(cmd.agent, 0) + len(cmd.requests)
        return real(self, cmd)
    monkeypatch.setattr(transport.SyntheticWorkers, "generate", counting)
    cfg = config(tmp_path, {"a": [1, 1], "b": [3, 3], "c": [2, 2]})
    simulate(tmp_path, cfg)
    episodes = 3 * 2 * 4
    assert asked == {"a": episodes, "b": 3 * episodes, "c": 2 * episodes}


def test_replies_are_as_long_as_asked_and_later_agents_see_longer_prompts(tmp_path):
    cfg = config(tmp_path, {}, context_carried=1.0)
    with h5py.File(simulate(tmp_path, cfg), "r") as f:
        resp = {a: f[f"samples/{a}"]["response_len"][:] for a in AGENTS}
        prompt = {a: f[f"samples/{a}"]["prompt_len"][:] for a in AGENTS}
        rows, toks = f["samples/a"][:], f["tokens/a"]["token"][:]
        replies = [toks[o + p:o + p + n] for o, p, n in zip(rows["token_offset"], rows["prompt_len"],
                                                             rows["response_len"])]
    # every reply token is a filler letter: no stop token ends one early, so it is as long as asked
    assert set(np.concatenate(replies).tolist()) <= set(SyntheticChatTokenizer.FILLER)
    # filler never holds a stop token: lengths vary (lognormal draws), none is cut to 0
    assert all(len(set(r.tolist())) > 3 and r.min() >= 1 and r.max() <= 512 for r in resp.values())
    assert prompt["a"].min() >= 128 and prompt["b"].mean() > prompt["a"].mean() + 0.5 * resp["a"].mean()
    assert prompt["c"].mean() > prompt["b"].mean()


def test_the_synthetic_tokenizer_is_byte_level_chatml_and_token_exact():
    tok = SyntheticChatTokenizer()
    text = "<|im_start|>user\nhé<|im_end|>\n"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids[-2] == tok.eos_id and len(ids) == len("user\nhé\n".encode()) + 2
    assert tok.decode(ids, skip_special_tokens=False) == text
    conv = Conversation(tok)
    first = conv.prompt_ids([{"role": "user", "content": "q"}])
    reply = conv.record([104, 105, tok.eos_id])
    second = conv.prompt_ids([{"role": "user", "content": "q"}, {"role": "assistant", "content": reply},
                              {"role": "user", "content": "more"}])
    assert reply == "hi" and second[:len(first) + 3] == first + [104, 105, tok.eos_id] and conv.rerendered == 0
    assert tok.decode([0xC3]) == "\ufffd"                      # a random model's broken UTF-8 still decodes


def test_a_checkpoint_for_some_agents_only_is_refused_by_name(tmp_path):
    raw = yaml.safe_load((ROOT / "configs/math_team.yaml").read_text())
    raw["agents"] = {"planner": {"checkpoint": ""}}
    raw["model"] = {"checkpoint": str(tmp_path)}
    # a checkpoint folder's config.json is read at load (config/checkpoint.py)
    (tmp_path / "config.json").write_text(json.dumps(ModelArgs(64, 32, 2, 4, 4, 64, 128).to_hf_config()))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"model.checkpoint: .*or for none, got none for \[.planner.\]"):
        load_config(tmp_path / "c.yaml")


def test_a_call_past_the_context_fails_its_episode_and_the_run_goes_on(tmp_path):
    cfg = config(tmp_path, {"b": [1, 3]}, prompt_tokens=900, context_carried=0.5, settle=False)
    cfg = dataclasses.replace(   # a config is frozen (config/plan.py)
        cfg, model=dataclasses.replace(cfg.model, max_seq_len=1024),   # the chain's carried context overflows c's prompt
        workflow=dataclasses.replace(cfg.workflow, max_failure_rate=1.0))  # most episodes fail: the run must go on
    path = simulate(tmp_path, cfg)
    check_exactly_once(path, 3, dropped_ok=True)      # the failed episodes' calls: dropped
    with h5py.File(path, "r") as f:
        assert len(f["samples/c"]) < len(f["samples/a"])          # some c calls never happened
        failed = set(zip(f["failures"]["input_id"][:].tolist(), f["failures"]["traj"][:].tolist()))
        assert failed and set(f["failures"]["kind"][:].tolist()) == {b"ContextFull"}
        for agent in ("a", "b"):
            s = f[f"samples/{agent}"][:]
            dropped = set(zip(s["input_id"][s["status"] == 3].tolist(), s["traj"][s["status"] == 3].tolist()))
            assert dropped <= failed and (agent == "b" or dropped == failed)


@pytest.mark.parametrize("name", ["paper_3x32b_7x14b", "paper_15x14b", "paper_5x32b"])
def test_the_paper_configs_run_the_text_episode_in_the_simulator(tmp_path, name):
    """Each agent once per episode, every call trained once, replies long-tailed up to the
    context (the paper's lengths, not the old 2-token game); 2 examples of 4 episodes a step,
    not 4 of 16 (time). The config's workload is `simulate paper`'s: the episode's defaults
    (no episode_args of its own: settle true, context 0.1) and the paper's batch shape."""
    cfg = load_config(ROOT / f"configs/{name}.yaml")
    assert cfg.workflow.episode == "flexmarl_hpc.workflows.paper_text:episode"
    assert (cfg.workflow.inputs_per_step, cfg.workflow.group_size) == (MA.queries, MA.branches) == (4, 16)
    assert cfg.workflow.episode_args == {} and DEFAULTS["settle"] is MA.settle is True
    assert {k: getattr(MA, k) for k in EPISODE_ARGS} == DEFAULTS
    cfg = load_config(ROOT / f"configs/{name}.yaml", ["run.steps=2", f"run.output_dir={tmp_path}",
                                                      "workflow.inputs_per_step=2", "workflow.group_size=4",
                                                      "run.checkpoint_every=0", "run.checkpoint_minutes=0"])
    path = simulate(tmp_path, cfg)
    check_exactly_once(path, 2)
    with h5py.File(path, "r") as f:
        ep = f["episodes"][:]
        assert len(ep) == 2 * 2 * 4 and (ep["calls"] == 1).all()
        lens = np.concatenate([f[f"samples/{a}"]["response_len"][:] for a in cfg.agent_names])
    assert np.median(lens) > 300 and lens.max() > 2000


def test_compare_prices_an_episodes_own_lengths_and_a_relays_modelled_ones(tmp_path):
    from flexmarl_hpc.sim.runs import priced
    from flexmarl_hpc.sim.driver import Workload
    hw = load_hardware("npu64_a3")
    assert priced(resolve(config(tmp_path, {})), hw, "synthetic")[1] is None
    assert isinstance(priced(load_plan(ROOT / "configs/relay3.yaml"), hw, "synthetic")[1], Workload)


def test_settled_agents_train_every_call_once_and_before_the_chain_ends(tmp_path):
    """settle: true (each agent's reward given at its reply): every call is still trained
    exactly once, and the chain's first agent trains before the last one's first reply is in
    (without settling, no call trains before its example's episodes have all ended)."""
    cfg = config(tmp_path, {}, settle=True)
    path = simulate(tmp_path, cfg)
    check_exactly_once(path, 3)
    with h5py.File(path, "r") as f:
        iv = f["intervals"][:]
    train = iv[iv["activity"] == b"train"]
    last_agent = iv[(iv["activity"] == b"generate") & (iv["agent"] == b"c")]
    assert train["t0"].min() < last_agent["t1"].min()
