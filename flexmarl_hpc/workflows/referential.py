"""Referential game (speaker -> listener), and its relay variant with 3+ agents.

The first agent sees one of K objects and sends a message of L symbols; each middle agent
sees only the previous message and sends a new one; the last agent sees only the last
message and names the object. Team reward: 1 for every agent if the object is right.
With two turns this is the classic speaker-listener game (chance = 1/K).

    workflow:
      task: flexmarl_hpc.workflows.referential:ReferentialGame
      task_args: {num_objects: 8, num_symbols: 8}
      turns: [{agent: speaker, samples: 4, max_new_tokens: 2},
              {agent: listener, samples: 4, max_new_tokens: 1}]
"""
from __future__ import annotations

import numpy as np

from flexmarl_hpc.workflows.base import MAX_TASK_TOKENS, Path, Task, Vocab, int_arg


class ReferentialGame(Task):
    stop_tokens = frozenset()          # fixed-length messages; action masks exclude <eos>

    def __init__(self, turns: list[str], num_objects: int = 8, num_symbols: int = 8):
        if len(turns) < 2:
            raise TypeError("the referential game needs at least 2 turns (speaker, listener)")
        self.turns = turns
        self.objects = [f"obj{i}" for i in range(int_arg(num_objects, "num_objects", 1, MAX_TASK_TOKENS))]
        self.symbols = [f"sym{i}" for i in range(int_arg(num_symbols, "num_symbols", 1, MAX_TASK_TOKENS))]
        self.vocab = Vocab(self.objects + self.symbols)
        self._sym_mask = self.vocab.mask(self.symbols)
        self._obj_mask = self.vocab.mask(self.objects)

    def sample_inputs(self, rng: np.random.Generator, n: int) -> list[int]:
        # every object equally often in a step (a permutation), then random for the rest
        k = len(self.objects)
        objs = list(rng.permutation(k)) * (n // k) + list(rng.integers(0, k, n % k))
        return [int(o) for o in objs]

    def heldout_inputs(self, n: int) -> list[int]:
        # the game's inputs are its K objects: nothing can be held out, so evaluation covers
        # every object equally often (greedy: it measures the learned code, not generalisation)
        return [i % len(self.objects) for i in range(n)]

    def prompt(self, turn: int, path: Path) -> list[int]:
        if turn == 0:
            return [Vocab.bos_id, self.vocab.index[self.objects[path.input]]]
        return [Vocab.bos_id, *path.responses[turn - 1]]

    def allowed_tokens(self, turn: int):
        return self._obj_mask if turn == len(self.turns) - 1 else self._sym_mask

    def reward(self, path: Path) -> dict[str, float]:
        answer = path.responses[-1][0] if path.responses[-1] else -1
        r = float(answer == self.vocab.index[self.objects[path.input]])
        return {agent: r for agent in self.turns}
