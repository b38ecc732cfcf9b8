"""An episode call's own sampling temperature / top_p (ctx.chat(temperature=, top_p=)) on the
torch engine, and what the trainer makes of it: the behaviour log-probs are those of the
distribution the call was drawn from, so the truncated importance weight corrects for the
gap to rollout.temperature, at which the trainer scores (learn/grpo.py).
The vLLM engine's side: tests/unit/test_vllm_engines.py; the episode side: test_episodes.py."""
from __future__ import annotations

import types

import torch

from flexmarl_hpc.learn.grpo import MicroBatch, grpo_loss, token_logprobs
from flexmarl_hpc.learn.model import ModelArgs, build_model, hf_state_dict
from flexmarl_hpc.learn.sampling import SamplingParams, generate
from flexmarl_hpc.rollout.base import GenRequest
from flexmarl_hpc.rollout.torch_engine import TorchEngine

ARGS = ModelArgs(vocab_size=30, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4,
                 intermediate_size=64, max_seq_len=32)
STOP = frozenset({2})


class Task:
    vocab = types.SimpleNamespace(pad_id=0)
    stop_tokens = STOP

    def allowed_tokens(self, turn):
        return None


def engine() -> TorchEngine:
    e = TorchEngine({"a": ARGS}, Task(), max_batch=4)
    e.load_weights("a", 1, hf_state_dict(build_model(ARGS, seed=3)))
    return e


def test_the_torch_engine_samples_each_request_at_its_own_params():
    reqs = [GenRequest("x", [1, 5, 6], 21, 6, 0, (0.5, 1.0)), GenRequest("y", [1, 7], 22, 6, 0)]
    got = engine().generate("a", reqs, SamplingParams(1.0, 0.8))
    want = generate(build_model(ARGS, seed=3).eval(), [[1, 5, 6], [1, 7]], [21, 22], [6, 6],
                    [SamplingParams(0.5, 1.0), SamplingParams(1.0, 0.8)], 0, STOP)
    assert [g.tokens for g in got] == [g.tokens for g in want]
    torch.testing.assert_close(torch.tensor(sum((g.logprobs for g in got), [])),
                               torch.tensor(sum((g.logprobs for g in want), [])), atol=1e-5, rtol=0)


def microbatch(prompt: list[int], tokens: list[int], logprobs: list[float]) -> MicroBatch:
    ids = torch.tensor([prompt + tokens])
    behav = torch.zeros(ids.shape, dtype=torch.float32)
    behav[0, len(prompt):] = torch.tensor(logprobs)
    return MicroBatch(ids, torch.tensor([len(prompt)]), torch.tensor([len(tokens)]), behav,
                      torch.tensor([1.0]), torch.tensor([False]), None)


def test_a_call_at_its_own_temperature_is_corrected_by_the_importance_weight():
    """The trainer scores at rollout.temperature (1.0 here). A call drawn at 1.0 has weight
    1 on every token; one drawn at 0.5 has the weight pi_1 / pi_0.5 of each token (capped),
    which it could only have if its behaviour log-probs were those of temperature 0.5."""
    e, model = engine(), build_model(ARGS, seed=3).eval()
    prompt, cap = [1, 5, 6], 5.0
    for temperature in (1.0, 0.5):
        (g,) = e.generate("a", [GenRequest("x", prompt, 31, 8, 0, (temperature, 1.0))], SamplingParams(1.0, 1.0))
        mb = microbatch(prompt, g.tokens, g.logprobs)
        with torch.no_grad():
            logp, ent = token_logprobs(model(mb.input_ids), mb, 1.0)
        _, stats = grpo_loss(logp, ent, mb, clip_eps=0.2, entropy_coef=0.0, tis_cap=cap)
        resp = logp[0, len(prompt):]
        with torch.no_grad():
            logits = model(mb.input_ids)[0, len(prompt) - 1:-1]
        at_t = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(g.tokens)[:, None])[:, 0]
        want = torch.exp(resp - at_t).clamp(max=cap).mean()
        torch.testing.assert_close(stats["tis_mean"], want, atol=1e-5, rtol=0)
        if temperature == 1.0:
            torch.testing.assert_close(stats["tis_mean"], torch.tensor(1.0), atol=1e-5, rtol=0)
        else:
            assert abs(float(stats["tis_mean"]) - 1.0) > 1e-2, stats["tis_mean"]
