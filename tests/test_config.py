import pytest

from flexmarl_hpc.config import Config, ConfigError, apply_override, help_text, load_config, to_dict
from tests.conftest import ROOT

LOCAL = ROOT / "configs" / "local.yaml"


def test_local_config_loads_and_overrides_apply():
    cfg = load_config(LOCAL, ["trainer.lr=1e-4", "run.steps=7", "rollout.replicas=3"])
    assert cfg.trainer.lr == 1e-4 and cfg.run.steps == 7 and cfg.rollout.replicas == 3
    assert cfg.agent_names == ["speaker", "listener"]
    assert cfg.num_trainer_groups == 2


@pytest.mark.parametrize("override, field, expected", [
    ("trainer.lrr=1", "trainer.lrr", "unknown key"),
    ("trainer.lr=abc", "trainer.lr", "expected float"),
    ("run.mode=fast", "run.mode", "expected one of"),
    ("run.steps=0", "run.steps", "expected 1..1000000000"),
    ("rollout.replicas=0", "rollout.replicas", ">= 1 replica"),
    ("trainer.groups=1", "trainer.groups", "no trainer"),
    ("trainer.groups=3", "trainer.groups", "at most 2"),
    ("model.num_heads=5", "model.num_heads", "not divisible"),
    ("trainer.tensor_parallel=2", "trainer.ranks_per_group", "multiple of"),
    ("agents.critic={hidden_size: 8}", "agents.critic", "no such agent"),
    ("workflow.turns=[]", "workflow.turns", "at least one turn"),
    ("model.checkpoint=/nonexistent", "model.checkpoint", "does not exist"),
    ("pipeline.overprovision=-1", "pipeline.overprovision", "expected >= 0"),
    ("agents.critic={hidden_size:", "agents.critic", "not valid YAML"),
    (("pipeline.overprovision=2", "run.mode=sync"), "pipeline.overprovision", "needs run.mode=flex"),
])
def test_bad_fields_are_named(override, field, expected):
    with pytest.raises(ConfigError) as e:
        load_config(LOCAL, list(override) if isinstance(override, tuple) else [override])
    assert str(e.value).startswith(field), str(e.value)
    assert expected in str(e.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(bad)


def test_override_syntax():
    d = {}
    apply_override(d, "a.b.c=[1, 2]")
    assert d == {"a": {"b": {"c": [1, 2]}}}
    with pytest.raises(ConfigError, match="key.path=value"):
        apply_override(d, "novalue")


def test_roundtrip_and_help():
    cfg = load_config(LOCAL)
    data = to_dict(cfg)
    assert data["trainer"]["betas"] == [0.9, 0.999]
    text = help_text(Config)
    assert "trainer.entropy_coef" in text and "Entropy bonus" in text


def test_bad_task_is_named(tmp_path):
    from flexmarl_hpc.build import build_task
    cfg = load_config(LOCAL, ["workflow.task=flexmarl_hpc.nope:Missing"])
    with pytest.raises(ConfigError, match="workflow.task: cannot import"):
        build_task(cfg)
    cfg = load_config(LOCAL, ["workflow.task_args={bogus: 1}"])
    with pytest.raises(ConfigError, match="workflow.task_args"):
        build_task(cfg)


def test_cli_reports_config_error_before_any_rank(tmp_path):
    import subprocess, sys
    p = subprocess.run([sys.executable, "-m", "flexmarl_hpc.run", str(LOCAL), "trainer.groups=1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "trainer.groups" in p.stderr and "launching" not in p.stdout
