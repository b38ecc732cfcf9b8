"""run.loggers: the config field (the loggers' output of a real run: tests/e2e/test_sinks.py)."""
import pytest

from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.config.load import load_config


def test_loggers_field_is_checked():
    assert load_config("configs/local.yaml").run.loggers == []
    cfg = load_config("configs/local.yaml", ["run.loggers=[tensorboard]"])
    assert cfg.run.loggers == ["tensorboard"]
    with pytest.raises(ConfigError, match=r"run.loggers\[0\]: expected one of \['tensorboard', 'wandb'\]"):
        load_config("configs/local.yaml", ["run.loggers=[mlflow]"])
    with pytest.raises(ConfigError, match="run.loggers: a logger is listed twice"):
        load_config("configs/local.yaml", ["run.loggers=[wandb, wandb]"])
