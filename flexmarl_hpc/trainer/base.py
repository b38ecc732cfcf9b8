"""The trainer backend interface: what a training engine implements for one agent.

Every rank of a trainer group holds one backend per agent it trains. Every rank receives
each micro-batch whole (broadcast once by the group leader as raw buffers,
ranks/workers.py: group_command) and cuts its own rows with `share`, a local cut with no
communication: the torch backend rows rank::size, megatron its data-parallel replica's
rows. The group calls `forward_backward` on that share (gradients accumulate, pre-scaled
by 1/global_batch), then `optimizer_step` once the agent's global batch is in (gradients
are reduced across the group inside). A weight sync streams (`sync_layouts`, `sync_senders`,
`sync_stream`: per PP stage, its HF tensors one at a time on the stage's sender, see
runtime/weight_sync.py); `named_weights` gives HF-named full tensors on the group leader
(tests, export); `state`/`load_state` carry model + optimizer + RNG as a
flat dict of tensors (checkpoints and state swapping use it; no pickled objects);
`save_checkpoint`/`load_checkpoint` write and read the agent's checkpoints, collective over
the group, each backend in its own format (torch: the leader's one file of `state()`;
megatron: every rank its shards); `onloaded` brings a shelved (offloaded) trainer onto its
device for a block, such as a weight sync of a parked agent.
`torch` (trainer/torch_trainer.py) is built in; `megatron` (the trainer/megatron/ package).

Several PPO epochs (trainer.ppo_epochs = E > 1, `finish_step`): on pass 1 a backend keeps
each micro-batch it trains (its own share and cut, in `kept`) with the token log-probs it
computed as `old_logprobs`; those are pi_old, the policy before the batch's first update,
obtained for free (pass 1's ratio is 1 by construction). After pass 1's optimizer step the
group replays passes 2..E locally, one optimizer step per pass (verl's ppo_epochs with one
mini-batch, GRPO's mu), and only then reports the step: the orchestrator sees one step and
one version bump per global batch whatever E is, the first pass keeps its micro-batch
overlap in flex mode, and a kill during the replay loses the whole step, which is redone
from the last checkpoint like any unreported step (nothing is trained twice).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, ContextManager, Protocol

import torch

from flexmarl_hpc import faults
from flexmarl_hpc.learn.grpo import MicroBatch


class TrainerBackend(Protocol):
    version: int
    kept: list          # pass-1 micro-batches of the current batch (ppo_epochs > 1), backend-owned

    def share(self, mb: MicroBatch) -> MicroBatch:
        """This rank's rows of the whole micro-batch `mb`, cut locally (no communication).
        The shares of the group's data-parallel replicas are disjoint and cover `mb`; the ranks
        of one replica (its TP and PP ranks) get the same rows."""

    def forward_backward(self, mb: MicroBatch, scale: float, last: bool = True) -> dict[str, float]:
        """`mb`: this rank's `share`. Accumulate gradients of scale * loss(mb); returns summed stats (loss, entropy, ...).
        `last`: the step's last micro-batch (a backend may start its gradient reduce in it)."""

    def replay_pass(self) -> dict[str, float]:
        """forward_backward over `kept` again, against their old_logprobs; summed stats."""

    def optimizer_step(self, bump: bool = True) -> dict[str, float]:
        """Reduce gradients over the group, clip, step, zero; bumps `version` (unless `bump`
        is False: a pass of several PPO epochs before the last); returns grad_norm."""

    def named_weights(self) -> dict[str, torch.Tensor]:
        """HF-named full weights (valid on the group leader; collective on a sharded
        trainer). Not on the sync path."""

    def sync_layouts(self) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
        """Per PP stage, (HF name, shape, dtype) of what `sync_stream` yields there, in order."""

    def sync_senders(self) -> list[int]:
        """Group rank of each PP stage's sender."""

    def sync_stream(self, pieces: dict[str, list[tuple[int, int]]] | None = None, dest=None):
        """Collective over the group: yields (HF name, tensor) on the stage senders, in
        `sync_layouts` order, one tensor at a time; a tensor `pieces` names (the plan's
        pieces, weight_sync.row_pieces) either whole or as those row ranges, one at a time
        (a sharded trainer gathers only those rows, in place in `dest.rows` where `dest`, a
        weight_sync.Destination, is given: the bucket being filled; a trainer that yields
        its own tensors may ignore it)."""

    def state(self) -> dict[str, torch.Tensor]:
        """Everything needed to continue training bit for bit, as named tensors."""

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of `state`."""

    def save_checkpoint(self, folder: Path, keep: int = 3) -> None:
        """Collective over the group: publish checkpoint `version` in `folder`, keeping the
        last `keep` (store/checkpoint.py's entries and manifests); a failure is a
        CheckpointError on every rank, and older checkpoints stay intact."""

    def load_checkpoint(self, folder: Path, report: Callable[[str], None] = print) -> int | None:
        """Collective over the group: load the newest valid checkpoint of `folder` (bad
        entries are reported and skipped); its version, None if there is none."""

    def onloaded(self) -> ContextManager[None]:
        """The trainer on its device for the block, shelved again after it if it was."""


REPLAY_STATS = ("clip_frac", "ppo_kl")
"""What a replay pass reports (its loss/entropy are not comparable to pass 1's, which the
step keeps); averaged over passes 2..E."""


def replay(tr: TrainerBackend, kept: list[tuple[MicroBatch, float]]) -> dict[str, float]:
    """One pass of forward_backward over (micro-batch, scale) pairs kept at pass 1."""
    acc: dict[str, float] = {}
    for i, (mb, scale) in enumerate(kept):
        for k, v in tr.forward_backward(mb, scale, last=i == len(kept) - 1).items():
            acc[k] = acc.get(k, 0.0) + v
    return acc


def finish_step(tr: TrainerBackend, epochs: int, stats: dict[str, float], group_sum) -> dict[str, float]:
    """After the batch's last micro-batch: the optimizer step, then passes 2..`epochs` each
    with its own step; returns the step's stats (`stats`: pass 1's, summed over the group;
    `group_sum`: a collective sum of a dict over the group, the same keys on every rank).
    Collective over the group. grad_norm is pass 1's; clip_frac and ppo_kl the replay's."""
    out = dict(stats)
    out.update(tr.optimizer_step(bump=epochs == 1))
    if epochs == 1:
        return out
    rep = dict.fromkeys(REPLAY_STATS, 0.0)
    try:
        for e in range(2, epochs + 1):
            s = tr.replay_pass()
            s = group_sum({k: s.get(k, 0.0) for k in REPLAY_STATS})
            faults.hit("ppo_replay")        # test-only: no-op unless FLEXMARL_FAULT is set
            tr.optimizer_step(bump=e == epochs)
            for k in REPLAY_STATS:
                rep[k] += s[k] / (epochs - 1)
    finally:
        tr.kept.clear()
    out.update(rep)
    return out


def train_micro(tr: TrainerBackend, mb, scale: float, last: bool, acc: dict[str, float],
                group_sum) -> dict[str, float] | None:
    """Forward and backward one micro-batch (`mb`: this rank's `share`), its stats added to
    `acc` (the step's so far); after the step's last one, `finish_step` on their sum over the
    group: returns the step's stats and clears `acc` (None before the last one)."""
    for k, v in tr.forward_backward(mb, scale, last=last).items():
        acc[k] = acc.get(k, 0.0) + v
    if not last:
        return None
    summed = finish_step(tr, tr.cfg.ppo_epochs, group_sum(acc), group_sum)
    acc.clear()
    return summed
