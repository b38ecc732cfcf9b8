"""Checks of the vLLM rollout engine against our model; run with the vLLM venv's python:

    .venv-vllm/bin/python tests/e2e/vllm_check.py [--bench]

(tests/e2e/test_vllm.py runs it.) Exits non-zero on the first failed check; prints one line per
check and, with --bench, tokens/s of the vLLM and torch engines on the same batch.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexmarl_hpc.config.schema import RolloutConfig  # noqa: E402
from flexmarl_hpc.learn.grpo import MicroBatch, token_logprobs  # noqa: E402
from flexmarl_hpc.learn.model import ModelArgs, build_model, hf_state_dict  # noqa: E402
from flexmarl_hpc.rollout.base import GenRequest  # noqa: E402
from flexmarl_hpc.rollout.torch_engine import TorchEngine  # noqa: E402
from flexmarl_hpc.rollout.vllm_engine import VLLMEngine  # noqa: E402
from flexmarl_hpc.learn.sampling import SamplingParams  # noqa: E402
from flexmarl_hpc.workflows.base import Vocab  # noqa: E402


class ToyTask:
    """Vocabulary of 40 tokens; turn 1 may only say tokens 3..12 (an action mask)."""
    vocab = Vocab([f"t{i}" for i in range(37)])
    stop_tokens = frozenset({Vocab.eos_id})

    def allowed_tokens(self, turn: int):
        if turn != 1:
            return None
        m = torch.zeros(len(self.vocab), dtype=torch.bool)
        m[3:13] = True
        return m


def trainer_logprobs(model, task, req: GenRequest, tokens: list[int], temperature: float) -> torch.Tensor:
    """The log-probs the trainer computes for a response (grpo.token_logprobs)."""
    ids = torch.tensor([req.prompt + tokens])
    allowed = task.allowed_tokens(req.turn)
    mb = MicroBatch(ids, torch.tensor([len(req.prompt)]), torch.tensor([len(tokens)]),
                    torch.zeros_like(ids, dtype=torch.float32), torch.zeros(1), torch.zeros(1, dtype=torch.bool),
                    None if allowed is None else allowed[None])
    with torch.no_grad():
        logp, _ = token_logprobs(model(ids), mb, temperature)
    return logp[0, len(req.prompt):len(req.prompt) + len(tokens)]


def check_against(model, engine, agent, task, reqs, params, what: str, tol: float = 1e-4) -> None:
    gens = engine.generate(agent, reqs, params)
    worst = 0.0
    for r, g in zip(reqs, gens):
        assert 1 <= len(g.tokens) <= r.max_new_tokens, (what, g.tokens)
        if Vocab.eos_id in g.tokens:
            assert g.tokens.index(Vocab.eos_id) == len(g.tokens) - 1, ("stop token must end", g.tokens)
        allowed = task.allowed_tokens(r.turn)
        if allowed is not None:
            assert all(bool(allowed[t]) for t in g.tokens), ("action mask violated", g.tokens)
        ref = trainer_logprobs(model, task, r, g.tokens, params.temperature)
        worst = max(worst, float((ref - torch.tensor(g.logprobs)).abs().max()))
    assert worst < tol, f"{what}: sampled-token log-probs differ from the trainer's by {worst:.2e}"
    print(f"ok {what}: {len(reqs)} requests, max |logprob - trainer logprob| {worst:.1e}", flush=True)


def main() -> None:
    bench = "--bench" in sys.argv
    task = ToyTask()
    V = len(task.vocab)
    cfg = RolloutConfig(backend="vllm", max_batch=64)
    params = SamplingParams(temperature=0.8)
    shapes = {
        "tied": ModelArgs(V, 128, 2, 4, 2, 256, 64, tie_embeddings=True),
        "untied": ModelArgs(V, 128, 2, 4, 4, 256, 64, rope_theta=5e4, tie_embeddings=False),
    }
    engine = VLLMEngine(shapes, task, cfg)
    reqs = [GenRequest(f"s{i}", [1] + [3 + (i * 7 + j) % 30 for j in range(2 + i % 5)], 1000 + i,
                       4 + i % 9, turn=i % 2) for i in range(24)]
    for agent, args in shapes.items():
        t0 = time.time()
        m0 = build_model(args, seed=1, std=0.3)
        engine.load_weights(agent, 0, hf_state_dict(m0))
        print(f"ok {agent}: engine built in {time.time() - t0:.1f} s", flush=True)
        check_against(m0, engine, agent, task, reqs, params, f"{agent} v0")
        # per-request seeds: a request's tokens do not depend on its batch
        alone = engine.generate(agent, reqs[5:6], params)[0]
        batch = engine.generate(agent, reqs, params)[5]
        assert alone.tokens == batch.tokens, (alone.tokens, batch.tokens)
        print(f"ok {agent}: same seed, same tokens alone and in a batch of {len(reqs)}", flush=True)
        # in-place update to new weights
        m1 = build_model(args, seed=2, std=0.3)
        t0 = time.time()
        engine.load_weights(agent, 1, hf_state_dict(m1))
        assert engine.version(agent) == 1
        print(f"ok {agent}: in-place weight update in {time.time() - t0:.2f} s", flush=True)
        check_against(m1, engine, agent, task, reqs, params, f"{agent} v1 (after update)")
    if bench:
        args = shapes["tied"]
        m = build_model(args, seed=1, std=0.3)
        ref = TorchEngine({"tied": args}, task, cfg.max_batch)
        ref.load_weights("tied", 0, hf_state_dict(m))
        engine.load_weights("tied", 2, hf_state_dict(m))
        big = [GenRequest(f"b{i}", [1, 3 + i % 30, 4], 7 + i, 48, turn=0) for i in range(64)]
        nostop = SamplingParams(temperature=1.0)
        task.stop_tokens = frozenset()
        for name, eng in (("vllm", engine), ("torch", ref)):
            eng.generate("tied", big[:4], nostop)          # warm-up
            t0 = time.time()
            n = sum(len(g.tokens) for g in eng.generate("tied", big, nostop))
            dt = time.time() - t0
            print(f"bench {name}: {n} tokens in {dt:.2f} s = {n / dt:.0f} tokens/s "
                  f"(64 sequences x 48 new tokens, torch threads {torch.get_num_threads()})", flush=True)
    engine.close()
    print("all vllm checks passed")


if __name__ == "__main__":
    main()
