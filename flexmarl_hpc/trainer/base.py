"""The trainer backend interface: what a training engine implements for one agent.

Every rank of a trainer group holds one backend per agent it trains. The group calls
`forward_backward` on its share of each micro-batch (gradients accumulate, pre-scaled by
1/global_batch), then `optimizer_step` once the agent's global batch is in (gradients are
reduced across the group inside). `named_weights` gives HF-named full tensors on the
group leader for the weight sync; `state`/`load_state` carry model + optimizer + RNG as a
flat dict of tensors (checkpoints and state swapping use it; no pickled objects).
`torch` (trainer/torch_trainer.py) is built in; `megatron` (the trainer/megatron/ package).
"""
from __future__ import annotations

from typing import Protocol

import torch

from ..grpo import MicroBatch


class TrainerBackend(Protocol):
    version: int

    def forward_backward(self, mb: MicroBatch, scale: float, last: bool = True) -> dict[str, float]:
        """Accumulate gradients of scale * loss(mb); returns summed stats (loss, entropy, ...).
        `last`: the step's last micro-batch (a backend may start its gradient reduce in it)."""

    def optimizer_step(self) -> dict[str, float]:
        """Reduce gradients over the group, clip, step, zero; bumps `version`; returns grad_norm."""

    def named_weights(self) -> dict[str, torch.Tensor]:
        """HF-named full weights (valid on the group leader)."""

    def state(self) -> dict[str, torch.Tensor]:
        """Everything needed to continue training bit for bit, as named tensors."""

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of `state`."""
