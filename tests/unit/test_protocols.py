"""The trainer backend protocol is complete: both backends implement every method of
`trainer.base.TrainerBackend` with its parameters, so the rank loops call them without
probing (issue 39: workers.py asked `hasattr` for checkpoints and the device onload).

    pytest tests/unit/test_protocols.py
"""
from __future__ import annotations

import ast
import inspect

import pytest

from flexmarl_hpc.trainer.base import TrainerBackend
from tests.conftest import ROOT

METHODS = [n for n, v in vars(TrainerBackend).items() if callable(v) and not n.startswith("_")]


def _backends():
    from flexmarl_hpc.trainer.megatron.trainer import MegatronTrainer
    from flexmarl_hpc.trainer.torch_trainer import TorchTrainer
    return TorchTrainer, MegatronTrainer


@pytest.mark.parametrize("method", METHODS)
def test_each_backend_implements_the_method_with_its_parameters(method):
    want = list(inspect.signature(getattr(TrainerBackend, method)).parameters)
    for cls in _backends():
        impl = getattr(cls, method, None)
        assert callable(impl), f"{cls.__name__} lacks {method}"
        got = list(inspect.signature(impl).parameters)
        assert got[:len(want)] == want, f"{cls.__name__}.{method}{got} vs the protocol's {want}"


def test_the_rank_loops_and_the_orchestrator_do_not_probe_their_parts():
    probes = []
    for folder in ("ranks", "orchestrator"):
        for path in sorted((ROOT / "flexmarl_hpc" / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr":
                    probes.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert probes == []


def test_the_torch_backend_checkpoints_through_the_protocol_live_and_shelved(tmp_path):
    """save_checkpoint then load_checkpoint into a fresh trainer, one live and one shelved
    (offloaded, as a parked agent is): the same state, version and all."""
    import torch
    from mpi4py import MPI
    from flexmarl_hpc.config.hf_config import ModelArgs
    from flexmarl_hpc.config.schema import TrainerConfig
    from flexmarl_hpc.learn.grpo import MicroBatch
    from flexmarl_hpc.learn.model import CausalLM
    from flexmarl_hpc.runtime.state_swap import HostBuffers
    from flexmarl_hpc.trainer.base import finish_step
    from flexmarl_hpc.trainer.torch_trainer import TorchTrainer
    args = ModelArgs(vocab_size=8, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2,
                     intermediate_size=32, max_seq_len=8)

    def trainer():
        return TorchTrainer(CausalLM(args), TrainerConfig(lr=0.05), MPI.COMM_SELF, temperature=1.0)
    g = torch.Generator().manual_seed(1)
    batch = MicroBatch(torch.randint(0, 8, (4, 6), generator=g), torch.full((4,), 2), torch.tensor([4, 3, 2, 4]),
                       -2.0 + 0.1 * torch.randn(4, 6, generator=g), torch.tensor([1.0, -1.0, 0.5, -0.5]),
                       torch.zeros(4, dtype=torch.bool), None)
    torch.manual_seed(0)
    tr = trainer()
    tr.forward_backward(batch, 1.0)
    finish_step(tr, 1, {}, lambda stats: stats)
    assert tr.load_checkpoint(tmp_path / "none") is None
    tr.save_checkpoint(tmp_path / "a", keep=2)
    want = tr.state()
    for shelved in (False, True):
        other = trainer()
        if shelved:
            other.offload(HostBuffers())
        assert other.load_checkpoint(tmp_path / "a", report=lambda line: None) == 1
        with other.onloaded():
            got = other.state()
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), shelved
