"""The rollout backend interface: what an inference engine implements to be a replica.

A replica rank owns one engine. The engine keeps the weights of the agents it serves
(`load_weights` replaces an agent's weights, bucket by bucket as a sync delivers them,
and records the version after the last) and
samples batches of requests with per-sample seeds. `torch` (rollout/torch_engine.py) is
built in; `vllm` (rollout/vllm_engine.py) drives a vLLM `LLM`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

import torch

from flexmarl_hpc.learn.sampling import Generation, SamplingParams


@dataclass
class GenRequest:
    sample_id: str
    prompt: list[int]
    seed: int
    max_new_tokens: int
    turn: int
    sampling: tuple[float, float] | None = None
    """(temperature, top_p) of this request alone (an episode call's `ctx.chat(temperature=,
    top_p=)`); None: the batch's params."""

    def params(self, batch: SamplingParams) -> SamplingParams:
        """The sampling params this request is drawn with."""
        return batch if self.sampling is None else SamplingParams(*self.sampling)


class RolloutEngine(Protocol):
    def load_weights(self, agent: str, version: int,
                     named: dict[str, torch.Tensor] | Iterable[dict[str, torch.Tensor]]) -> None:
        """Replace `agent`'s weights (HF names) with `named` and mark them as `version`.
        `named` may come as parts (a weight sync's buckets, runtime/weight_sync.py): each is
        valid only until the next is drawn, so load it before; mark the version after the last."""

    def version(self, agent: str) -> int | None:
        """Version of `agent` held, or None."""

    def generate(self, agent: str, requests: list[GenRequest], params: SamplingParams) -> list[Generation]:
        """Sample every request with `agent`'s current weights (each with `r.params(params)`);
        results in request order, each with the log-probs of the distribution it was drawn from."""

    def start(self) -> None:
        """Build now what serving needs, at start-up inside run.build_timeout_s (vLLM: its
        engines, which the sync groups' set-up would otherwise build); torch: nothing."""

    def remote(self, agent: str):
        """The engine's own workers that receive a sync of `agent` (vLLM's TP workers on
        GPUs, joining the sync groups themselves), or None: this process receives."""

    def take_dropped(self) -> list[str]:
        """Agents whose weights the engine let go since the last call (vLLM's sleep mode
        frees an engine's weights), so the orchestrator stops routing them here."""
