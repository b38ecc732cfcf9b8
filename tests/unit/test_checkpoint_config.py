"""A checkpoint's config.json is the source of truth of its shapes (config/checkpoint.py).

    pytest -q tests/unit/test_checkpoint_config.py

configs/smollm2_arith.yaml sets `model.checkpoint` and no shape field; its checkpoint is
replaced here by a folder whose config.json is written by ModelArgs.to_hf_config (the writer
of save_hf_checkpoint) with 8 heads, where ModelConfig's default is 4.
"""
from __future__ import annotations

import json

import pytest
import yaml

from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.config.hf_config import ModelArgs
from tests.conftest import ROOT

ARITH = ROOT / "configs" / "smollm2_arith.yaml"
EIGHT = ModelArgs(vocab_size=400, hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=8,
                  intermediate_size=256, max_seq_len=512, rope_theta=50000.0, rms_eps=1e-5,
                  tie_embeddings=False, qkv_bias=True)


def checkpoint(folder, args: ModelArgs = EIGHT):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(args.to_hf_config()))
    return folder


def megatron_tp(tp: int) -> list[str]:
    return [f"trainer.tensor_parallel={tp}", f"trainer.ranks_per_group={tp}"]


def test_tp8_is_accepted_with_only_the_checkpoint_set(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt")
    cfg = load_config(ARITH, [f"model.checkpoint={ckpt}", *megatron_tp(8)])
    m = cfg.model
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.intermediate_size) == (128, 4, 8, 8, 256)
    assert (m.max_seq_len, m.rope_theta, m.rms_eps, m.tie_embeddings, m.qkv_bias) == (512, 50000.0, 1e-5, False, True)


def test_a_yaml_field_that_disagrees_is_refused_by_name(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt")
    with pytest.raises(ConfigError) as e:
        load_config(ARITH, [f"model.checkpoint={ckpt}", "model.num_heads=4"])
    assert str(e.value).startswith(f"model.num_heads: 4 in the config, 8 in {ckpt / 'config.json'} "
                                   "(num_attention_heads)"), str(e.value)
    assert "\n" not in str(e.value)
    # a field that agrees is fine (a config saved by a run states every shape)
    assert load_config(ARITH, [f"model.checkpoint={ckpt}", "model.num_heads=8"]).model.num_heads == 8


def test_a_tp_that_does_not_divide_the_real_heads_names_the_checkpoints_value(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt")
    with pytest.raises(ConfigError) as e:
        load_config(ARITH, [f"model.checkpoint={ckpt}", *megatron_tp(16)])
    assert str(e.value).startswith("trainer.tensor_parallel: 16 does not divide the 8 heads / 8 KV heads"), str(e.value)
    assert str(ckpt / "config.json") in str(e.value)
    with pytest.raises(ConfigError, match="trainer.pipeline_parallel: 3 does not divide the 4 layers"):
        load_config(ARITH, [f"model.checkpoint={ckpt}", "trainer.pipeline_parallel=3", "trainer.ranks_per_group=3"])


def test_a_per_agent_checkpoint_is_resolved_and_checked_by_name(tmp_path):
    ckpt8 = checkpoint(tmp_path / "eight")
    ckpt4 = checkpoint(tmp_path / "four", ModelArgs(400, 64, 2, 4, 2, 128, 256))
    base = [f"model.checkpoint={ckpt4}", f"agents.solver.checkpoint={ckpt8}"]
    cfg = load_config(ARITH, base)
    assert cfg.model_for("solver").num_heads == 8 and cfg.model_for("verifier").num_kv_heads == 2
    with pytest.raises(ConfigError, match=r"^agents\.solver\.num_layers: 2 in the config, 4 in .*eight"):
        load_config(ARITH, [*base, "agents.solver.num_layers=2"])
    with pytest.raises(ConfigError, match="trainer.tensor_parallel: 8 does not divide the 4 heads / 2 KV heads "
                                          "of agent 'verifier'"):
        load_config(ARITH, [*base, *megatron_tp(8)])


@pytest.mark.parametrize("content, expected", [
    (None, "no config.json"),
    ("{not json", "not valid JSON"),
    ('{"model_type": "llama"}', "no 'num_attention_heads'"),
    (json.dumps({**EIGHT.to_hf_config(), "hidden_size": "128"}), "hidden_size: expected an integer >= 1, got '128'"),
])
def test_a_bad_config_json_is_one_line_naming_the_file(tmp_path, content, expected):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    if content is not None:
        (ckpt / "config.json").write_text(content)
    with pytest.raises(ConfigError) as e:
        load_config(ARITH, [f"model.checkpoint={ckpt}"])
    msg = str(e.value)
    assert msg.startswith(f"model.checkpoint: {ckpt}") and expected in msg and "\n" not in msg, msg


def test_print_config_shows_the_checkpoints_shapes(tmp_path, capsys):
    from flexmarl_hpc.run import main
    ckpt = checkpoint(tmp_path / "ckpt")
    assert main([str(ARITH), f"model.checkpoint={ckpt}", "--print-config"]) == 0
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert (model["num_heads"], model["hidden_size"], model["num_layers"], model["max_seq_len"]) == (8, 128, 4, 512)


def test_a_config_saved_before_shapes_were_resolved_still_loads(tmp_path):
    """config.yaml of an older run states every model field, its shapes at the defaults the
    runtime never used; export and analysis of that run take the checkpoint's. A config saved
    now states the checkpoint's shapes and loads as it is."""
    from flexmarl_hpc.config.load import save_config, to_dict
    from flexmarl_hpc.config.schema import ModelConfig
    ckpt = checkpoint(tmp_path / "ckpt")
    raw = yaml.safe_load(ARITH.read_text())
    raw["model"] = to_dict(ModelConfig(checkpoint=str(ckpt)))
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(raw))
    assert load_config(tmp_path / "old.yaml").model.num_heads == 8
    save_config(load_config(ARITH, [f"model.checkpoint={ckpt}"]), tmp_path / "new.yaml")
    assert load_config(tmp_path / "new.yaml").model.hidden_size == 128


MATH_TEAM = ROOT / "configs" / "math_team.yaml"


@pytest.mark.parametrize("present, missing", [((), "tokenizer.json and no tokenizer_config.json"),
                                              (("tokenizer.json",), "tokenizer_config.json:")])
def test_an_episode_workflow_names_the_tokenizer_files_it_lacks(tmp_path, capsys, present, missing):
    from flexmarl_hpc.run import main
    ckpt = checkpoint(tmp_path / "ckpt")
    for name in present:
        (ckpt / name).write_text("{}")
    rc = main([str(MATH_TEAM), f"model.checkpoint={ckpt}", f"run.output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"config error: model.checkpoint: {ckpt} has no {missing}"), err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()
