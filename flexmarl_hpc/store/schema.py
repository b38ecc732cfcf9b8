"""The store's schema: its version, the sample statuses and each table's columns (one
compound record a row), documented in docs/store.md. No HDF5 writing here: `table.Table`
writes the records, `tables.StoreFile` the file."""
from __future__ import annotations

import h5py
import numpy as np

from flexmarl_hpc.store.checksum import MUTABLE

# 3: Fletcher-32 on every chunk; 4: /tools and /episodes; 5: /failures; 6: /samples retokenized, prefill_len
SCHEMA_VERSION = 6
READS = (1, 2, 3, 4, 5, 6)            # versions flexmarl_hpc.analysis.load reads
GENERATED, READY, CONSUMED, DROPPED = 0, 1, 2, 3
STATUS_NAMES = {GENERATED: "generated", READY: "ready", CONSUMED: "consumed", DROPPED: "dropped"}

SAMPLE_COLUMNS = {
    "sample_id": "S64", "parent_id": "S64", "input_id": "i8", "turn": "i4", "traj": "i8",
    "step": "i8", "policy_version": "i8", "replica": "i4", "status": "i1", "reward": "f4",
    "advantage": "f4", "trainer_step": "i8", "t_generated": "f8", "t_ready": "f8",
    "t_consumed": "f8", "token_offset": "i8", "prompt_len": "i4", "response_len": "i4",
    "retokenized": "i1", "prefill_len": "i4",
}
# /samples columns a schema version added (docs/store.md): a file of an earlier version lacks
# them, and analysis.load and salvage read them as 0 (what a fixed-turn sample has)
SAMPLE_SINCE = {"retokenized": 6, "prefill_len": 6}
TOKEN_COLUMNS = {"token": "i4", "logprob": "f4"}
STEP_COLUMNS = {
    "step": "i8", "version": "i8", "t_end": "f8", "n_samples": "i4", "n_micro": "i4",
    "loss": "f4", "reward_mean": "f4", "entropy": "f4", "kl": "f4", "grad_norm": "f4",
    "logp_mismatch": "f4", "tis_mean": "f4", "staleness_max": "i4", "staleness_mean": "f4",
    "rows_offset": "i8", "rows_len": "i4", "superseded": "i1", "clip_frac": "f4", "ppo_kl": "f4",
}
INTERVAL_COLUMNS = {"rank": "i4", "role": "S16", "activity": "S16", "agent": "S32",
                    "t0": "f8", "t1": "f8"}
EVENT_COLUMNS = {"agent": "i2", "row": "i8", "status": "i1", "t": "f8", "trainer_step": "i8",
                 "reward": "f4", "advantage": "f4"}
METRIC_COLUMNS = {
    "step": "i8", "t": "f8", "wall": "f8", "samples": "i8", "tokens": "i8",
    "samples_per_s": "f4", "rollout_s": "f4", "train_s": "f4", "sync_s": "f4", "swap_s": "f4",
    "utilization": "f4", "staleness_max": "i4", "superseded": "i1",
}
EVAL_COLUMNS = {
    "step": "i8", "agent": "S64", "metric": "S64", "mode": "S8", "value": "f8", "n_inputs": "i4",
    "n_paths": "i4", "version": "i8", "t_start": "f8", "t_end": "f8",
}

TOOL_COLUMNS = {"t": "f8", "agent": "i2", "input_id": "i8", "traj": "i8", "call": "i4",
                "tool": "S64", "outcome": "i1", "latency_s": "f4"}
# /tools outcome codes: the index here (append only). The sandbox's outcomes
# (tools.sandbox.OUTCOMES, also the pool's for a reward function), 'refused' (tools.registry:
# input a tool will not run) and 'reward_error' (a reward function returned, but no usable
# reward); docs/tools.md and docs/store.md say what each means
TOOL_OUTCOMES = ("ok", "error", "timeout", "killed_cpu", "memory", "file_size", "crashed",
                 "refused", "launch_failed", "reward_error")

# /failures: one row per failed episode (schema 5). Fixed-size text, cut to fit: the message's
# first bytes, the traceback's last (its innermost frames, where the error is), UTF-8
FAILURE_TEXT = {"kind": 64, "message": 512, "traceback": 4096}
FAILURE_COLUMNS = {"t": "f8", "step": "i8", "input_id": "i8", "traj": "i8",
                   **{k: f"S{n}" for k, n in FAILURE_TEXT.items()}}


def episode_columns(n_agents: int) -> dict[str, str]:
    """/episodes: one row per finished episode; `calls` and `reward` hold one entry per
    agent (attrs `agents` order), so the row's dtype depends on the run's agents."""
    return {"step": "i8", "input_id": "i8", "traj": "i8", "t": "f8",
            "calls": f"({n_agents},)i4", "reward": f"({n_agents},)f4"}


def eval_key(agent: str, metric: str, mode: str) -> str:
    """How an /eval row is named in logs, sinks and analyze: "agent/metric" (greedy) or
    "agent/metric/sample"; the task's own metrics (agent "") under "task"."""
    return f"{agent or 'task'}/{metric}" + ("" if mode == "greedy" else f"/{mode}")


# a column an append may leave out, and its value (anything else missing is an error)
DEFAULTS = {"superseded": 0, "retokenized": 0, "prefill_len": 0, "logp_mismatch": np.nan, "tis_mean": np.nan,
            "reward": np.nan, "advantage": np.nan, "clip_frac": np.nan, "ppo_kl": np.nan}
# columns added within schema 2: a file written before lacks them, and a resume into it
# writes its rows without them (analysis reads them as NaN)
ADDED = {"clip_frac", "ppo_kl"}
# what an event sets in its sample's row (the rest of the row is written once)
STATUS_FIELDS = ("status", "reward", "advantage", "trainer_step", "t_ready", "t_consumed")
assert MUTABLE["/samples/"] == STATUS_FIELDS        # the prefix checksum leaves them out


def table_names(agents: list[str]) -> list[str]:
    """The tables of a store for `agents`, in /commit's order (StoreFile creates them so)."""
    per = [f"/{t}/{a}" for t in ("samples", "tokens", "steps", "step_rows") for a in agents]
    return per + ["/intervals", "/events", "/metrics", "/eval", "/tools", "/episodes", "/failures"]


def dtype_of(columns: dict[str, str]) -> np.dtype:
    return np.dtype([(k, v) for k, v in columns.items()])


def check_file(f: h5py.File, path) -> None:
    """Refuse a file that is not ours or is of another schema version, saying which."""
    if f.attrs.get("program") != "flexmarl_hpc":
        raise ValueError(f"{path}: not a flexmarl_hpc run file (no program=flexmarl_hpc attribute)")
    v = int(f.attrs.get("schema_version", -1))
    if v != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema version {v}; this flexmarl_hpc writes version "
                         f"{SCHEMA_VERSION} (resume it with the release that wrote it)")


def sample_columns(version: int) -> dict[str, str]:
    """The /samples columns a file of schema `version` has (SAMPLE_SINCE)."""
    return {c: t for c, t in SAMPLE_COLUMNS.items() if SAMPLE_SINCE.get(c, 0) <= version}
