"""Long sequences on the megatron trainer, structurally (no GPU): trainer.recompute* reach
megatron's TransformerConfig, and one function (configs.use_te) picks Transformer Engine's
layer spec where it is importable on a GPU, the local one otherwise, saying so once.

    pytest tests/unit/test_megatron_configs.py
"""
from __future__ import annotations

import sys
import types

import pytest

from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.config.schema import ConfigError, TrainerConfig
from tests.conftest import ROOT

from flexmarl_hpc.learn.model import ModelArgs
from flexmarl_hpc.trainer.megatron import configs      # megatron itself only inside its functions

ARGS = ModelArgs(23, 32, 4, 4, 2, 64, 16)


@pytest.fixture
def megatron():
    pytest.importorskip("megatron.core", reason="megatron-core (pip install -r requirements-megatron.txt)")


def _tconfig(**trainer):
    return configs.transformer_config(ARGS, TrainerConfig(backend="megatron", **trainer), cuda=False)


def test_recompute_reaches_the_transformer_config(megatron):
    full = _tconfig(recompute="full")
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    block = _tconfig(recompute="full", recompute_method="block", recompute_num_layers=2)
    assert (block.recompute_granularity, block.recompute_method, block.recompute_num_layers) == ("full", "block", 2)
    sel = _tconfig(recompute="selective")
    assert (sel.recompute_granularity, sel.recompute_method, sel.recompute_num_layers) == ("selective", None, None)
    assert sel.recompute_modules == ["core_attn"]          # the T x T attention scores
    none = _tconfig()
    assert none.recompute_granularity is None and none.recompute_method is None


@pytest.mark.parametrize("overrides, field", [
    (["trainer.recompute=full", "trainer.recompute_num_layers=0"], "trainer.recompute_num_layers: expected >= 1"),
    (["trainer.recompute=full", "trainer.recompute_num_layers=3"],          # 4 layers / PP 2 = 2 per stage
     "trainer.recompute_num_layers: 3 is more than the 2 layers per pipeline stage of agent 'speaker'"),
    (["trainer.recompute=selective", "trainer.recompute_method=block"], "trainer.recompute_method: applies to"),
    (["trainer.recompute_num_layers=2"], "trainer.recompute_num_layers: applies to trainer.recompute=full"),
    (["trainer.recompute=fast"], "trainer.recompute: expected one of"),
])
def test_bad_recompute_settings_are_refused_naming_the_field(overrides, field):
    base = ["trainer.backend=megatron", "trainer.ranks_per_group=2", "trainer.pipeline_parallel=2",
            "model.num_layers=4"]
    load_config(ROOT / "configs/local.yaml", [*base, "trainer.recompute=full", "trainer.recompute_num_layers=2"])
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/local.yaml", [*base, *overrides])
    assert str(e.value).startswith(field), str(e.value)


def test_layer_spec_is_transformer_engine_where_importable_on_a_gpu(monkeypatch):
    said: list[str] = []
    monkeypatch.setitem(sys.modules, "transformer_engine", None)          # absent: import fails
    assert configs.use_te(cuda=True, notify=said.append) is False
    assert said == [configs.LOCAL_SPEC_NOTICE] and "\n" not in said[0]
    assert configs.use_te(cuda=False, notify=said.append) is False and len(said) == 1   # CPU: by design
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    assert configs.use_te(cuda=True, notify=said.append) is True and len(said) == 1
    assert configs.use_te(cuda=False, notify=said.append) is False       # TE kernels need CUDA


def test_layer_spec_follows_the_choice(megatron, monkeypatch):
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    built = []
    monkeypatch.setattr(specs, "get_gpt_layer_with_transformer_engine_spec", lambda: built.append("te") or "TE")
    assert configs.layer_spec(True) == "TE" and built == ["te"]
    local = configs.layer_spec(False)
    assert local.submodules.self_attention.submodules.core_attention is DotProductAttention and built == ["te"]
