"""On CPU (trainer/megatron/compat.py) megatron's TP RNG tracker forks the CPU generator:
a draw inside `fork()` (dropout) advances the tracked state, the caller's comes back on exit,
and megatron's "CPU RNG state changed within GPU RNG context" (logged on every such fork,
so on every CPU step) is not logged: on CPU it only says the tracked state was used."""
from __future__ import annotations

import logging

import torch


def test_fork_draws_from_the_tracked_state_without_the_warning(caplog):
    from flexmarl_hpc.trainer.megatron import compat
    compat.apply()
    from megatron.core.tensor_parallel import random as tp_random
    tracker = tp_random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(7)
    outer = torch.get_rng_state()
    with caplog.at_level(logging.WARNING):
        with tracker.fork():
            first = torch.rand(4)
        with tracker.fork():
            second = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outer)          # the caller's stream untouched
    assert not torch.equal(first, second)                     # the tracked state advanced
    torch.manual_seed(1234)
    assert torch.equal(first, torch.rand(4))                  # drawn from the tracked seed
    assert not [r for r in caplog.records if "CPU RNG state changed" in r.getMessage()]
    tracker.reset()
