"""trainer.collective_timeout_s reaches the megatron group's torch.distributed world: its
TCPStore (the rendezvous of the group's ranks) and init_process_group (every collective's
timeout, which NCCL's watchdog enforces). Recording fakes stand in for torch.distributed on
a one-rank group (MPI.COMM_SELF): the real set-up runs over gloo in tests/mpi/test_megatron.py."""
from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.config.schema import ConfigError


def _init(monkeypatch, **kw) -> list:
    from flexmarl_hpc.trainer.megatron import compat, dist
    seen = []

    class Store:
        def __init__(self, host, port, size, is_master, timeout, **_):
            self.port = 1234
            seen.append(("store", timeout.total_seconds()))
    monkeypatch.setattr(dist, "_LAYOUT", None)
    monkeypatch.setattr(torch.distributed, "TCPStore", Store)
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend, store, rank, world_size, timeout: seen.append(("pg", timeout.total_seconds())))
    monkeypatch.setattr(dist, "_parallel_state", lambda tp, pp: None)
    monkeypatch.setattr(dist.atexit, "register", lambda *a: None)
    monkeypatch.setattr(compat, "apply", lambda: None)
    dist.init_group_distributed(MPI.COMM_SELF, 1, 1, **kw)
    return seen


def test_the_groups_store_and_collectives_take_the_configured_timeout(monkeypatch):
    assert _init(monkeypatch) == [("store", 1800.0), ("pg", 1800.0)]          # the default, 30 min
    assert _init(monkeypatch, timeout_s=42.5) == [("store", 42.5), ("pg", 42.5)]
    with pytest.raises(ValueError, match="trainer.collective_timeout_s"):
        _init(monkeypatch, timeout_s=0)


def test_the_trainer_passes_its_config_field(monkeypatch):
    from flexmarl_hpc.trainer.megatron import trainer
    got = []

    def stop(group, tp, pp, timeout_s):
        got.append(timeout_s)
        raise RuntimeError("stop after the set-up")
    monkeypatch.setattr(trainer, "init_group_distributed", stop)
    cfg = load_config("configs/local.yaml", ["trainer.backend=megatron", "trainer.collective_timeout_s=90"])
    with pytest.raises(RuntimeError, match="stop after"):
        trainer.MegatronTrainer(None, cfg.trainer, MPI.COMM_SELF, 1.0)
    assert got == [90.0]


@pytest.mark.parametrize("value", ["0", "-1", ".nan"])
def test_a_non_positive_timeout_is_refused_naming_the_field(value):
    with pytest.raises(ConfigError, match=r"trainer\.collective_timeout_s: expected (> 0|a finite)"):
        load_config("configs/local.yaml", [f"trainer.collective_timeout_s={value}"])
