"""Built-in rollout engine: our decoder with a KV cache, batched. CPU-only (its weights come
and go as host tensors; build.py warns on a GPU rank): GPU runs use rollout.backend=vllm."""
from __future__ import annotations

from typing import Iterable

import torch

from flexmarl_hpc.learn.model import CausalLM, ModelArgs
from flexmarl_hpc.learn.sampling import Generation, SamplingParams, generate
from flexmarl_hpc.workflows.base import Task
from flexmarl_hpc.rollout.base import GenRequest


class TorchEngine:
    def __init__(self, args_of: dict[str, ModelArgs], task: Task, max_batch: int):
        self.args_of = args_of
        self.task = task
        self.max_batch = max_batch
        self.models: dict[str, CausalLM] = {}
        self.versions: dict[str, int] = {}

    def load_weights(self, agent: str, version: int,
                     named: dict[str, torch.Tensor] | Iterable[dict[str, torch.Tensor]]) -> None:
        """`named`: the weights, or an iterable of parts of them (a sync's buckets, each
        loaded before the next is received); the version is set after the last."""
        model = self.models.get(agent)
        if model is None:
            model = self.models[agent] = CausalLM(self.args_of[agent]).eval()
        seen: set[str] = set()
        for part in ([named] if isinstance(named, dict) else named):
            _, unexpected = model.load_state_dict(part, strict=False)
            if unexpected:
                raise ValueError(f"weights for {agent}: unexpected {unexpected[:3]}")
            seen.update(part)
        missing = [m for m in model.state_dict() if m not in seen
                   and not (model.args.tie_embeddings and m == "lm_head.weight")]
        if missing:
            raise ValueError(f"weights for {agent}: missing {missing[:3]}")
        self.versions[agent] = version

    def version(self, agent: str) -> int | None:
        return self.versions.get(agent)

    def start(self) -> None:
        """Nothing to build ahead: each model is made at its first load."""

    def remote(self, agent: str) -> None:
        return None                      # this process receives every sync

    def take_dropped(self) -> list[str]:
        return []                        # every loaded agent stays loaded

    def generate(self, agent: str, requests: list[GenRequest], params: SamplingParams) -> list[Generation]:
        model = self.models[agent]
        out: list[Generation] = []
        for i in range(0, len(requests), self.max_batch):
            chunk = requests[i:i + self.max_batch]
            out += generate(model, [r.prompt for r in chunk], [r.seed for r in chunk],
                            [r.max_new_tokens for r in chunk], [r.params(params) for r in chunk],
                            self.task.vocab.pad_id,
                            self.task.stop_tokens, [self.task.allowed_tokens(r.turn) for r in chunk])
        return out
