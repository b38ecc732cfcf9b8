"""launch/preflight.py's estimate_memory: the shipped local configs fit a laptop, and what
grows with the config (inputs_per_step) grows the estimate. Refusals are in test_bad_inputs.py."""
from __future__ import annotations

import pytest

from tests.conftest import ROOT

GiB = 2**30


def _estimate(config: str, overrides=(), models=None):
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.config.plan import resolve
    from flexmarl_hpc.launch.preflight import estimate_memory
    from flexmarl_hpc.config.hf_config import model_args
    from flexmarl_hpc.workflows.build import build_task
    cfg = load_config(ROOT / "configs" / config, list(overrides))
    if models is None:
        task = build_task(cfg)
        models = {a: model_args(cfg, task, a) for a in cfg.agent_names}
    return estimate_memory(resolve(cfg), models(cfg) if callable(models) else models)


@pytest.mark.parametrize("config", ["local.yaml", "relay3.yaml", "skewed.yaml", "hetero_cpu.yaml"])
def test_shipped_local_configs_fit_a_laptop(config):
    est = _estimate(config)
    print(f"{config}: {est.total / 2**20:.0f} MiB ({est})")
    assert est.total < 4 * GiB


@pytest.mark.parametrize("config", ["smollm2_arith.yaml", "smollm2_learn.yaml"])
def test_smollm2_configs_fit_a_workstation(config):
    """Their checkpoint is not in the repository: SmolLM2-135M's shape (its config.json)."""
    from flexmarl_hpc.learn.model import ModelArgs
    smollm2 = ModelArgs(49152, 576, 30, 9, 3, 1536, 8192)
    est = _estimate(config, ["model.checkpoint=", "workflow.task=x:Y", "workflow.task_args={}", "run.eval_every=0"],
                    lambda cfg: {a: smollm2 for a in cfg.agent_names})
    print(f"{config}: {est.total / 2**20:.0f} MiB ({est})")
    assert 2 * GiB < est.total < 16 * GiB       # 135M params x 16 bytes of trainer state alone: 2 GiB


def test_estimate_grows_with_the_samples_in_flight():
    small, big = _estimate("local.yaml"), _estimate("local.yaml", ["workflow.inputs_per_step=1600"])
    assert big.samples == 100 * small.samples
    assert (big.ranks, big.trainer, big.replicas) == (small.ranks, small.trainer, small.replicas)
    stale = _estimate("local.yaml", ["pipeline.max_staleness=2"])
    assert stale.samples == 2 * small.samples          # 4 steps in flight instead of 2


def test_bytes_per_weight_are_the_engines_dtype_for_the_pools_fit_and_preflight():
    """One count of a replica's bytes per weight (config.resources.replica_bytes_per_weight):
    the torch engine's parameters are fp32, vLLM's dtype is engine_dtype's; the pools' fit
    (weight_gb) and preflight's replica memory read it (weight_gb counted the torch engine at
    2 bytes, preflight at 4)."""
    import dataclasses

    import torch
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.config.resources import param_count, replica_bytes_per_weight, weight_gb
    from flexmarl_hpc.learn.model import CausalLM, ModelArgs
    from flexmarl_hpc.rollout.vllm_engine import engine_dtype
    torch_engine = next(CausalLM(ModelArgs(16, 8, 1, 2, 1, 16, 32)).parameters()).element_size()
    cfg = load_config(ROOT / "configs" / "local.yaml", [])
    for dtype in ("auto", "bf16", "fp16", "fp32"):
        for cuda in (True, False):
            vllm = dataclasses.replace(cfg.rollout, backend="vllm", dtype=dtype)
            assert replica_bytes_per_weight(vllm, cuda) == getattr(torch, engine_dtype(dtype, cuda)).itemsize
    for dtype in ("auto", "fp32"):                  # the dtypes validate allows the torch engine
        for cuda in (True, False):
            assert replica_bytes_per_weight(dataclasses.replace(cfg.rollout, dtype=dtype), cuda) == torch_engine
    agent = cfg.agent_names[0]
    assert cfg.rollout.backend == "torch"
    assert weight_gb(cfg, agent) == param_count(cfg.model_for(agent)) * torch_engine / 1e9
    from flexmarl_hpc.config.plan import resolve
    from flexmarl_hpc.launch.preflight import estimate_memory
    models = {a: ModelArgs(64, 32, 2, 4, 2, 64, 64) for a in cfg.agent_names}

    def replicas(backend, dtype, cuda=True):
        c = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, backend=backend, dtype=dtype))
        return estimate_memory(resolve(c), models, cuda).replicas
    assert replicas("torch", "auto") == replicas("vllm", "fp32") == replicas("vllm", "auto", cuda=False)
    assert replicas("vllm", "bf16") == replicas("vllm", "auto") < replicas("torch", "auto")
