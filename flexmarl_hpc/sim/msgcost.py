"""The orchestrator's own cost per byte of a message, measured on this CPU.

A reply reaches the orchestrator as a pickled Python object (mpi4py's lowercase send/recv)
and its tokens become numpy rows of the experience store: `byte_cost_s` times that round
trip (pickle, unpickle, to int32/float32 arrays) for Generated replies of growing size and
returns the fitted seconds per byte (the slope, median of `reps` interleaved repetitions).
`simulate capacity` prints it next to the seconds per command; the hardware profiles'
`orchestrator_s` and `orchestrator_byte_s` hold those measurements (dated in their YAML).
"""
from __future__ import annotations

import pickle
import time

import numpy as np

from flexmarl_hpc.runtime import messages


def _round_trip_s(reply: messages.Generated) -> float:
    t = time.perf_counter()
    back = pickle.loads(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
    for toks, logps in back.outputs:
        np.asarray(toks, dtype=np.int32), np.asarray(logps, dtype=np.float32)
    return time.perf_counter() - t


def byte_cost_s(tokens: tuple[int, ...] = (2_000, 20_000, 200_000), reps: int = 3) -> float:
    """Seconds per byte of a Generated reply's round trip (16 responses of tokens/16 each)."""
    sizes, fits = [], []
    replies = []
    for n in tokens:
        r = messages.Generated(0, [(list(range(n // 16)), [-0.5] * (n // 16)) for _ in range(16)])
        replies.append(r)
        sizes.append(len(pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL)))
    for _ in range(reps):
        secs = [_round_trip_s(r) for r in replies]          # interleaved: one of each per rep
        fits.append(np.polyfit(sizes, secs, 1)[0])
    return float(max(np.median(fits), 0.0))
