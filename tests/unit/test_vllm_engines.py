"""Structural tests of the vLLM engine manager with a fake `vllm` module (no vLLM, no GPU here):
how many engines a replica holds after rebinding among agents of the same / different
architectures, and what the engines are built with (dtype, memory, TP, sleep mode).
The fake LLM records its kwargs and every call; the real API it mirrors is vLLM's
`LLM(..., enable_sleep_mode=True)`, `sleep(level=)`, `wake_up(tags=)`, `collective_rpc`."""
from __future__ import annotations

import sys
import types
from dataclasses import replace

import pytest
import torch

from flexmarl_hpc.config.schema import ConfigError, RolloutConfig
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.learn.model import ModelArgs, build_model, hf_state_dict
from flexmarl_hpc.rollout.base import GenRequest
from flexmarl_hpc.learn.sampling import SamplingParams

SMALL = ModelArgs(vocab_size=19, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
                  intermediate_size=48, max_seq_len=16)
BIG = replace(SMALL, num_layers=3)


class FakeLLM:
    built: list["FakeLLM"] = []

    def __init__(self, model: str, **kwargs):
        self.model, self.kwargs, self.calls = model, kwargs, []
        self.awake = True
        FakeLLM.built.append(self)

    def sleep(self, level: int = 1):
        self.calls.append(("sleep", level))
        self.awake = False

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags or ())))
        self.awake = True

    def collective_rpc(self, fn, args=()):
        weights, _tied = args
        assert self.awake, "weights loaded into a sleeping engine"
        self.calls.append(("reload", dict(weights)["model.norm.weight"].clone()))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, sps, use_tqdm=False):
        assert self.awake and sum(e.awake for e in FakeLLM.built) == 1 or not self.kwargs.get(
            "enable_sleep_mode"), "two engines awake at once"
        self.calls.append(("generate", len(prompts)))
        tok = types.SimpleNamespace(logprob=-0.5)
        out = types.SimpleNamespace(token_ids=[3], logprobs=[{3: tok}])
        return [types.SimpleNamespace(outputs=[out]) for _ in prompts]


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.LLM = FakeLLM
    vllm.SamplingParams = lambda **kw: kw
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda **kw: kw
    vllm.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    FakeLLM.built = []
    return FakeLLM


class Task:
    stop_tokens = frozenset({2})

    def allowed_tokens(self, turn):
        return None


def weights(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    named = hf_state_dict(build_model(args, seed=seed))
    named["model.norm.weight"] = torch.full_like(named["model.norm.weight"], float(seed))  # a fingerprint
    return named


def gen(engine, agent):
    req = GenRequest("s", [1, 4], seed=0, max_new_tokens=2, turn=0)
    return engine.generate(agent, [req], SamplingParams(1.0, 1.0))


def reloads(llm) -> list[float]:
    return [float(c[1][0]) for c in llm.calls if c[0] == "reload"]


def make(args_of, tmp_path, cuda, **cfg):
    from flexmarl_hpc.rollout.vllm_engine import VLLMEngine
    return VLLMEngine(args_of, Task(), RolloutConfig(backend="vllm", max_batch=4, **cfg),
                      workdir=str(tmp_path), cuda=cuda)


@pytest.mark.parametrize("cuda", [False, True])
def test_same_architecture_shares_one_engine_switched_by_reload(fake_vllm, tmp_path, cuda):
    e = make({"a": SMALL, "b": SMALL}, tmp_path, cuda)
    e.load_weights("a", 1, weights(SMALL, 1))
    e.load_weights("b", 1, weights(SMALL, 2))
    gen(e, "b")                       # b's weights into the engine built with a's
    gen(e, "a")                       # back to a: reloaded from the host copy
    gen(e, "a")                       # bound: no reload
    e.load_weights("a", 2, weights(SMALL, 3))     # a is bound: loaded straight from the sync
    gen(e, "a")
    assert len(fake_vllm.built) == 1 and len(e.engines) == 1
    llm = fake_vllm.built[0]
    assert reloads(llm) == [2.0, 1.0, 3.0]
    assert not any(c[0] in ("sleep", "wake_up") for c in llm.calls)
    assert e.version("a") == 2 and e.version("b") == 1


def test_gpu_engines_of_different_architectures_sleep_one_awake(fake_vllm, tmp_path):
    e = make({"a": SMALL, "b": BIG, "c": SMALL}, tmp_path, cuda=True)
    e.load_weights("a", 1, weights(SMALL, 1))
    e.load_weights("b", 1, weights(BIG, 2))       # builds the second engine: a's sleeps first
    e.load_weights("c", 1, weights(SMALL, 3))
    for agent in ("b", "a", "c", "b", "a"):
        gen(e, agent)
    assert len(fake_vllm.built) == 2 and len(e.engines) == 2
    small, big = fake_vllm.built
    for llm in (small, big):
        assert llm.kwargs["enable_sleep_mode"] is True
        assert llm.kwargs["gpu_memory_utilization"] == 0.85     # one awake at a time: the whole budget
        assert llm.kwargs["dtype"] == "bfloat16" and llm.kwargs["tensor_parallel_size"] == 1
    assert ("sleep", 2) in small.calls and ("sleep", 2) in big.calls
    # wake-up: weights, load, then KV cache (the weight load never sits beside a KV cache)
    i = small.calls.index(("wake_up", ("weights",)))
    assert small.calls[i + 1][0] == "reload" and small.calls[i + 3] == ("wake_up", ("kv_cache",))
    assert reloads(small) == [1.0, 3.0, 1.0]        # a (woken), c (switch), a (woken again)
    assert sum(llm.awake for llm in fake_vllm.built) == 1


def test_cpu_keeps_architectures_resident_without_sleep(fake_vllm, tmp_path):
    e = make({"a": SMALL, "b": BIG}, tmp_path, cuda=False)
    e.load_weights("a", 1, weights(SMALL, 1))
    e.load_weights("b", 1, weights(BIG, 2))
    gen(e, "a"), gen(e, "b"), gen(e, "a")
    assert len(fake_vllm.built) == 2
    assert e.host == {}                              # nobody evicts anybody: no host copies
    for llm in fake_vllm.built:
        assert "enable_sleep_mode" not in llm.kwargs and "gpu_memory_utilization" not in llm.kwargs
        assert llm.kwargs["dtype"] == "float32"
        assert not any(c[0] in ("sleep", "wake_up", "reload") for c in llm.calls)


def test_dtype_and_tensor_parallel_reach_the_engine(fake_vllm, tmp_path):
    """The replica's GPU block (rollout.gpus_per_replica) is the engine's TP size."""
    e = make({"a": SMALL}, tmp_path, cuda=True, dtype="fp16", gpus_per_replica=2)
    e.load_weights("a", 1, weights(SMALL, 1))
    assert fake_vllm.built[0].kwargs["dtype"] == "float16"
    assert fake_vllm.built[0].kwargs["tensor_parallel_size"] == 2


def test_rollout_dtype_needs_vllm():
    with pytest.raises(ConfigError, match="rollout.dtype"):
        load_config("configs/local.yaml", ["rollout.dtype=bf16"])
    cfg = load_config("configs/local.yaml", ["rollout.dtype=bf16", "rollout.backend=vllm"])
    assert cfg.rollout.dtype == "bf16"
