"""Continuous batching under a KV-cache capacity: admission waits for room, and a full cache
preempts the latest admitted sequence (vLLM's recompute preemption), which later re-prefills
its prompt and what it had generated.

Event-driven and exact for the model below; pure (numpy only):
- `slots` sequences at most decode at once (max_num_seqs); the cache holds `capacity`
  tokens (KV room / bytes per token);
- a sequence is admitted (FIFO, a preempted one first) when a slot is free and its tokens so
  far fit with one more token for it and for every running sequence;
- every decode step each running sequence adds a token; before a step that would overflow,
  the latest admitted sequences are preempted (their tokens freed) until it fits;
- a sequence of length L leaves after its L-th token, freeing prompt + L.
Between two events (an end, an overflow) nothing changes but the holdings, which grow by the
running count per step, so the schedule is a few segments, not a loop over steps.
`sim.costs.generate_s` uses it when the plain schedule (`decode_schedule`) would overflow.
"""
from __future__ import annotations

from collections import deque

import numpy as np


def kv_schedule(lengths, prompt_tokens: int, slots: int, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Per decode step the running sequences and the tokens they hold (as `decode_schedule`),
    and the tokens re-prefilled after preemptions."""
    lengths = [int(x) for x in lengths]
    p = int(prompt_tokens)
    if lengths and p + max(lengths) > capacity:
        raise ValueError(f"kv cache: a response of {max(lengths)} tokens after a {p}-token prompt needs "
                         f"{p + max(lengths)} tokens of KV cache, more than the replica's {capacity}")
    done = [0] * len(lengths)                 # tokens generated per sequence
    waiting, running = deque(range(len(lengths))), []
    held, recompute = 0, 0
    segs: list[tuple[int, int, int]] = []     # (running, held at the first step, steps)
    while waiting or running:
        # room for the newcomer and for every running sequence's next token
        while waiting and len(running) < slots and held + p + done[waiting[0]] + len(running) + 1 <= capacity:
            i = waiting.popleft()
            recompute += (p + done[i]) if done[i] else 0
            held += p + done[i]
            running.append(i)
        a = len(running)                       # >= 1: the check above lets one sequence always fit
        to_end = min(lengths[i] - done[i] for i in running)
        fit = (capacity - held) // a           # steps before the cache would overflow
        k = min(to_end, fit)
        if k > 0:
            segs.append((a, held, k))
            held += a * k
            for i in running:
                done[i] += k
        for i in [i for i in running if done[i] == lengths[i]]:
            running.remove(i)
            held -= p + lengths[i]
        while running and held + len(running) > capacity:
            i = running.pop()                  # the latest admitted
            held -= p + done[i]
            waiting.appendleft(i)
    return (*_expand(segs), recompute)


def _expand(segs: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
    if not segs:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    a = np.array([s[0] for s in segs], dtype=np.int64)
    h = np.array([s[1] for s in segs], dtype=np.int64)
    k = np.array([s[2] for s in segs], dtype=np.int64)
    active = np.repeat(a, k)
    offset = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)
    return active, np.repeat(h, k) + np.repeat(a, k) * offset
