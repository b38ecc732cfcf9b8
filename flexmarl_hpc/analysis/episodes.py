"""Per-episode numbers of a run: how many calls each agent made per episode (the skew the
load balancer meets) and what the tool calls did. Pure functions of a `load.Run`.

    from flexmarl_hpc.analysis.episodes import calls_per_episode, calls_summary, tool_stats
    calls, source = calls_per_episode(run)     # one row per (episode, agent): calls
    calls_summary(run)["per_agent"]["solver"]  # episodes, mean, min, max, hist {calls: episodes}
    tool_stats(run)["python"]                  # calls, outcomes {name: n}, latency median/p95
    failure_stats(run)                         # failed episodes, by kind, and calls dropped

Where the calls come from (`source`), in this order:
  - `/episodes` (schema 4, a workflow that records its episodes): exact, an agent that made no
    call counts 0, and an episode a kill cut short is not there;
  - `/samples` rows of episode calls (their parent_id is "<agent>/<sample_id>"): grouped by
    (input_id, traj), unfinished episodes included;
  - `/samples` of a fixed-turn tree (parent_id a bare sample id): one episode per complete
    root-to-leaf path (its leaf at the last turn), the calls of each agent along it. Grouping
    by (input_id, traj) would be wrong there: a branching turn gives each child its own traj.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from flexmarl_hpc.analysis.load import Run

COLUMNS = ["input_id", "traj", "agent", "calls"]


def calls_per_episode(run: Run) -> tuple[pd.DataFrame, str]:
    """(one row per episode and agent: input_id, traj, agent, calls; where they come from)."""
    if not run.episodes.empty:
        ep = run.episodes.drop_duplicates(["input_id", "traj", "agent"], keep="last")
        return ep[COLUMNS].reset_index(drop=True), "/episodes"
    s = run.samples
    if s.empty or not run.agents:
        return pd.DataFrame({c: [] for c in COLUMNS}), "none"
    if s["parent_id"].str.contains("/", regex=False).any():
        n = s.groupby(["input_id", "traj", "agent"]).size().unstack("agent")
        n = n.reindex(columns=run.agents).fillna(0).astype(int)
        out = n.stack().rename("calls").reset_index()
        return out[COLUMNS], "/samples by (input_id, traj)"
    return _tree_paths(s, run.agents), "/samples tree paths"


def _tree_paths(s: pd.DataFrame, agents: list[str]) -> pd.DataFrame:
    """Calls per agent along each complete root-to-leaf path of fixed-turn trees."""
    n = len(s)
    ids = s["sample_id"].to_numpy()
    pos = pd.Series(np.arange(n), index=ids)
    pos = pos[~pos.index.duplicated(keep="last")]
    parent = pos.reindex(s["parent_id"].to_numpy()).fillna(-1).to_numpy(np.int64)
    has_child = np.zeros(n, bool)
    has_child[parent[parent >= 0]] = True
    turn = s["turn"].to_numpy()
    leaves = np.flatnonzero(~has_child & (turn == turn.max()))     # a shorter path is unfinished
    code = pd.Categorical(s["agent"], categories=agents).codes
    counts = np.zeros((len(leaves), len(agents)), np.int64)
    cur, which = leaves.copy(), np.arange(len(leaves))
    for _ in range(int(turn.max()) + 2):                # a path has one node per turn
        alive = cur >= 0
        if not alive.any():
            break
        np.add.at(counts, (which[alive], code[cur[alive]]), 1)
        cur[alive] = parent[cur[alive]]
    return pd.DataFrame({"input_id": np.repeat(s["input_id"].to_numpy()[leaves], len(agents)),
                         "traj": np.repeat(s["traj"].to_numpy()[leaves], len(agents)),
                         "agent": np.tile(np.array(agents, object), len(leaves)),
                         "calls": counts.reshape(-1)})


def calls_summary(run: Run) -> dict:
    """{"source", "per_agent": {agent: {"episodes", "mean", "min", "max", "hist": {calls: n}}}}."""
    calls, source = calls_per_episode(run)
    per_agent = {}
    for a in run.agents:
        c = calls.loc[calls["agent"] == a, "calls"].astype(int)
        if len(c):
            per_agent[a] = {"episodes": int(len(c)), "mean": float(c.mean()), "min": int(c.min()),
                            "max": int(c.max()),
                            "hist": {int(k): int(v) for k, v in c.value_counts().sort_index().items()}}
    return {"source": source, "per_agent": per_agent}


def tool_stats(run: Run) -> dict:
    """{tool: {"calls", "outcomes": {outcome: n}, "latency_median_s", "latency_p95_s"}}."""
    out = {}
    for tool, g in run.tools.groupby("tool", sort=True):
        lat = g["latency_s"].astype(float).to_numpy()
        out[str(tool)] = {"calls": int(len(g)),
                          "outcomes": {str(k): int(v) for k, v in g["outcome"].value_counts().sort_index().items()},
                          "latency_median_s": float(np.median(lat)),
                          "latency_p95_s": float(np.percentile(lat, 95))}
    return out


def failure_stats(run: Run) -> dict:
    """{"episodes": failed, "by_kind": {kind: n}, "first": {kind: its first message},
    "calls_dropped": calls of failed episodes left out of training (status dropped)}."""
    f = run.failures
    if not len(f):
        return {"episodes": 0, "by_kind": {}, "first": {}, "calls_dropped": 0}
    first = f.sort_values("t").drop_duplicates("kind")
    s = run.samples
    failed = set(zip(f["input_id"].tolist(), f["traj"].tolist()))
    dropped = 0
    if len(s):
        d = s[s["status_name"] == "dropped"]
        dropped = sum(k in failed for k in zip(d["input_id"].tolist(), d["traj"].tolist()))
    return {"episodes": int(len(f)),
            "by_kind": {str(k): int(v) for k, v in f["kind"].value_counts().items()},
            "first": dict(zip(first["kind"].astype(str), first["message"].astype(str))),
            "calls_dropped": int(dropped)}
