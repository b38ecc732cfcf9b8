"""A micro-batch on the wire: the orchestrator packs its samples into padded numpy arrays
(the `arrays` of a `messages.Train`), a trainer rank unpacks them into a `grpo.MicroBatch`:

    arrays = pack_microbatch(nodes, task)            # rank 0, from the experience tree
    mb = microbatch_from_arrays(cmd.arrays)          # a trainer rank (or sim.inprocess)

Both sides live here so the array names and dtypes are written down once.
"""
from __future__ import annotations

from itertools import chain
from typing import Protocol, Sequence

import numpy as np
import torch

from flexmarl_hpc.learn.grpo import MicroBatch
from flexmarl_hpc.workflows.base import Task


class Sample(Protocol):
    """What a micro-batch needs of a sample (an `experience.Node`)."""
    prompt: Sequence[int]
    response: Sequence[int]
    logprobs: Sequence[float]
    turn: int
    advantage: float
    version: int
    step: int


def pack_microbatch(nodes: Sequence[Sample], task: Task) -> dict:
    """The padded arrays of a micro-batch, filled by one scatter per array (not per sample)."""
    P = np.array([len(n.prompt) for n in nodes])
    R = np.array([len(n.response) for n in nodes])
    L = P + R
    B, T = len(nodes), int(L.max()) if len(nodes) else 1       # B = 0: an empty step
    col = np.arange(T)
    ids = np.full((B, T), task.vocab.pad_id, dtype=np.int64)
    # chain.from_iterable walks the parts in C: a generator per token was most of the
    # simulator's packing time on the paper tasks (8k-token replies)
    ids[col < L[:, None]] = np.fromiter(
        chain.from_iterable(part for n in nodes for part in (n.prompt, n.response)), np.int64, int(L.sum()))
    behav = np.zeros((B, T), dtype=np.float32)
    behav[(col >= P[:, None]) & (col < L[:, None])] = np.fromiter(
        chain.from_iterable(n.logprobs for n in nodes), np.float32, int(R.sum()))
    return {"input_ids": ids, "behav_logprobs": behav, "allowed": _allowed(nodes, task),
            "prompt_lens": P, "response_lens": R,
            "advantages": np.array([n.advantage for n in nodes], dtype=np.float32),
            "stale": np.array([n.version < n.step for n in nodes])}


def _allowed(nodes: Sequence[Sample], task: Task) -> np.ndarray | None:
    """[B, V] action mask of each sample's turn, or None when no turn restricts its tokens."""
    masks = {t: task.allowed_tokens(t) for t in {n.turn for n in nodes}}
    if all(m is None for m in masks.values()):
        return None
    V = len(task.vocab)
    rows = {t: np.ones(V, bool) if m is None else m.numpy() for t, m in masks.items()}
    return np.stack([rows[n.turn] for n in nodes])


def microbatch_from_arrays(d: dict) -> MicroBatch:
    """The tensors of a packed micro-batch (the arrays are not copied where dtypes agree)."""
    t = lambda k, dt=None: None if d.get(k) is None else torch.as_tensor(d[k], dtype=dt)
    return MicroBatch(t("input_ids", torch.long), t("prompt_lens", torch.long),
                      t("response_lens", torch.long), t("behav_logprobs", torch.float32),
                      t("advantages", torch.float32), t("stale", torch.bool), t("allowed", torch.bool))
