"""A skewed load: a chain of agents whose response lengths differ by an order of magnitude
between agents and are long-tailed (log-normal) within an agent.

Agent k answers the previous agent's response; its sample's length budget is
base_k * LogNormal(0, sigma), drawn from a hash of the sample id (so it is the same in
every mode and on every replica). Reward: the fraction of an agent's tokens equal to its
target symbol (learnable, per agent). Used by bench/bench_modes.py.

    workflow:
      task: flexmarl_hpc.workflows.skewed:SkewedLengths
      task_args: {base_lengths: [4, 16, 64], sigma: 0.8}
"""
from __future__ import annotations

import hashlib

import numpy as np

from flexmarl_hpc.workflows.base import MAX_TASK_TOKENS, Path, Task, TaskArgError, Vocab, float_arg, int_arg


class SkewedLengths(Task):
    stop_tokens = frozenset()

    def __init__(self, turns: list[str], base_lengths: list[int], sigma: float = 0.8,
                 num_symbols: int = 8, max_length: int = 160):
        if not isinstance(base_lengths, list) or len(base_lengths) != len(turns):
            raise TaskArgError("base_lengths", f"expected a list of one length per turn ({len(turns)}), "
                                               f"got {base_lengths!r}")
        max_length = int_arg(max_length, "max_length", 1, MAX_TASK_TOKENS)
        base = [int_arg(b, f"base_lengths[{i}]", 1, max_length) for i, b in enumerate(base_lengths)]
        self.turns, self.base, self.cap = turns, base, max_length
        self.sigma = float_arg(sigma, "sigma", 0.0, 10.0)
        self.symbols = [f"s{i}" for i in range(int_arg(num_symbols, "num_symbols", 1, MAX_TASK_TOKENS))]
        self.vocab = Vocab(self.symbols + ["q"])
        self._mask = self.vocab.mask(self.symbols)

    def sample_inputs(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(x) for x in rng.integers(0, len(self.symbols), n)]

    def heldout_inputs(self, n: int) -> list[int]:
        return [i % len(self.symbols) for i in range(n)]     # the whole (tiny) input space

    def prompt(self, turn: int, path: Path) -> list[int]:
        if turn == 0:
            return [Vocab.bos_id, self.vocab.index["q"], self.vocab.index[self.symbols[path.input]]]
        return [Vocab.bos_id, *path.responses[turn - 1][-8:]]

    def allowed_tokens(self, turn: int):
        return self._mask

    def response_budget(self, turn: int, sample_id: str, default: int) -> int:
        h = int.from_bytes(hashlib.blake2b(sample_id.encode(), digest_size=8).digest(), "little")
        z = np.random.default_rng(h).standard_normal()
        return int(np.clip(round(self.base[turn] * np.exp(self.sigma * z)), 1, min(default, self.cap)))

    def reward(self, path: Path) -> dict[str, float]:
        out = {}
        for t, agent in enumerate(self.turns):
            r = path.responses[t]
            target = self.vocab.index[self.symbols[t % len(self.symbols)]]
            out[agent] = float(np.mean([x == target for x in r])) if r else 0.0
        return out
