"""HF config fields that change the math: rope_parameters (transformers 5.x), top-level
rope_theta + rope_scaling (4.x), Llama-3 RoPE scaling. Our decoder loaded from a small
random Qwen2 / Llama saved by transformers gives transformers' logits; anything else that
changes the math is refused by name."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from flexmarl_hpc.learn.model import CausalLM, ModelArgs, load_hf_checkpoint
from tests.conftest import ROOT

BASE = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
        "max_position_embeddings": 256}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


IDS = torch.randint(0, 64, (2, 200), generator=torch.Generator().manual_seed(0))


def _compare(hf_model, tmp_path) -> tuple[float, torch.nn.Module]:
    hf_model = hf_model.float().eval()
    hf_model.save_pretrained(tmp_path)
    ours = load_hf_checkpoint(tmp_path).eval()
    with torch.no_grad():
        return (hf_model(input_ids=IDS).logits - ours(IDS)).abs().max().item(), ours


def test_qwen2_rope_theta_1e6_matches_transformers(transformers, tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**{k: v for k, v in BASE.items() if k != "model_type"},
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                   tie_word_embeddings=False)
    err, ours = _compare(transformers.Qwen2ForCausalLM(cfg), tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_theta" not in saved or saved["rope_theta"] == 1e6          # 5.x: under rope_parameters
    assert ours.args.rope_theta == 1e6 and ours.args.qkv_bias
    assert err < 2e-5, err


def test_llama3_rope_scaling_matches_transformers(transformers, tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{k: v for k, v in BASE.items() if k != "model_type"},
                                   rope_parameters=dict(LLAMA3), tie_word_embeddings=True)
    err, ours = _compare(transformers.LlamaForCausalLM(cfg), tmp_path)
    assert ours.args.rope_llama3 == (8.0, 1.0, 4.0, 32)
    assert err < 2e-5, err
    # the scaling matters at these lengths: without it the logits are far off (~8e-4)
    plain = CausalLM(dataclasses.replace(ours.args, rope_llama3=None)).eval()
    plain.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (plain(IDS) - ours(IDS)).abs().max().item() > 1e-4


def test_transformers_4_layout_reads_the_same():
    v5 = ModelArgs.from_hf_config({**BASE, "rope_parameters": dict(LLAMA3)})
    legacy = {k: v for k, v in LLAMA3.items() if k not in ("rope_type", "rope_theta")}
    v4 = ModelArgs.from_hf_config({**BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **legacy}})
    assert v4 == v5 and v5.rope_theta == 500000.0
    assert ModelArgs.from_hf_config({**BASE, "rope_theta": 1e6}).rope_theta == 1e6
    # our own writer round-trips (vLLM and export read it)
    assert ModelArgs.from_hf_config(v5.to_hf_config()) == v5


@pytest.mark.parametrize("extra, field", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "llama3 scaling without"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 16}, "head_dim"),
    ({"model_type": "mistral"}, "model_type"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
])
def test_math_changing_fields_are_refused_by_name(extra, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ModelArgs.from_hf_config({**BASE, **extra})


def test_refusal_reaches_the_cli_as_a_config_error(tmp_path, capsys):
    from flexmarl_hpc.run import main
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({**BASE, "rope_parameters": {"rope_type": "yarn"}}))
    rc = main([str(ROOT / "configs/local.yaml"), f"model.checkpoint={ckpt}", f"run.output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("config error: model.checkpoint:") and "rope_type" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()
