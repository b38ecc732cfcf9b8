"""Writes tests/golden/store_v3.h5: a tiny schema-3 store, made with the store code of commit
dbb25ca (the last one writing version 3), kept so that readers of version 3 stay tested.

    git worktree add /tmp/v3 dbb25ca && cd /tmp/v3 && PYTHONPATH=. python tests/golden/make_store_v3.py OUT.h5

A fixed-turn tree as the orchestrator writes it: agents a (turn 0, 2 samples per input) and b
(turn 1, 1 sample per parent), 2 inputs; every sample consumed by step 0; two /steps rows each.
Running it at a later commit writes that commit's schema, not a golden version-3 file.
"""
import sys

import numpy as np

from flexmarl_hpc.store.tables import StoreFile
from flexmarl_hpc.store.schema import CONSUMED, GENERATED, READY


def main(path: str) -> None:
    s = StoreFile(path, ["a", "b"], {"mode": "sync", "world_size": 3,
                                     "config_yaml": "workflow:\n  turns: [a, b]\n"}, chunk=8)
    for turn, agent in enumerate(["a", "b"]):
        rows = np.zeros(4, s.samples[agent].dtype)
        for k, (inp, traj) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
            rows[k]["sample_id"] = f"{inp}_{turn}_{traj}".encode()
            rows[k]["parent_id"] = f"{inp}_0_{traj}".encode() if turn else b""
            rows[k]["input_id"], rows[k]["turn"], rows[k]["traj"] = inp, turn, traj
        rows["status"], rows["reward"], rows["advantage"] = CONSUMED, [1, 0, 1, 1], 0.5
        rows["trainer_step"], rows["t_generated"], rows["t_ready"], rows["t_consumed"] = 0, 1.0, 2.0, 3.0
        rows["token_offset"], rows["prompt_len"], rows["response_len"] = np.arange(4) * 3, 2, 1
        s.samples[agent].append(rows)
        tok = np.zeros(12, s.tokens[agent].dtype)
        tok["token"], tok["logprob"] = np.arange(12), np.nan
        s.tokens[agent].append(tok)
        ev = np.zeros(12, s.events.dtype)
        ev["agent"], ev["row"] = turn, np.tile(np.arange(4), 3)
        ev["status"] = np.repeat([GENERATED, READY, CONSUMED], 4)
        ev["t"], ev["trainer_step"], ev["reward"], ev["advantage"] = np.repeat([1.0, 2.0, 3.0], 4), -1, np.nan, np.nan
        ev["trainer_step"][8:] = 0
        ev["reward"][4:], ev["advantage"][4:] = np.tile([1, 0, 1, 1], 2), 0.5
        s.events.append(ev)
        st = np.zeros(1, s.steps[agent].dtype)
        st["step"], st["version"], st["t_end"], st["n_samples"], st["reward_mean"] = 0, 1, 4.0, 4, 0.75
        st["rows_len"] = 4
        s.steps[agent].append(st)
        s.step_rows[agent].append(np.arange(4, dtype=np.int64))
    s.close()


if __name__ == "__main__":
    main(sys.argv[1])
