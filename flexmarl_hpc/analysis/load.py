"""Load a run's HDF5 file into pandas DataFrames, for notebooks and `flexmarl_hpc.analyze`.

    from flexmarl_hpc.analysis.load import load_run, summary
    run = load_run("runs/local/local.h5")      # works while the job is still writing (SWMR)
    run.samples.groupby("agent").reward.mean()
    summary(run)["utilization"]

DataFrames: `samples` (one row per sample, all agents, column `agent`; `staleness` =
trainer_step - policy_version for consumed samples), `steps` (one row per optimizer step
and agent), `intervals` (per-rank busy/wait intervals), `metrics` (one row per global step),
`events` (every status change), `evals` (held-out evaluation, one row per step, agent,
metric and mode; empty without run.eval_every), `tools` (one row per tool or reward-function
call; `agent` "" for a reward function, `outcome` by name) and `episodes` (one row per finished
episode and agent: `calls`, `reward`; both empty before schema 4, and `episodes` for runs whose
workflow records none), `failures` (one row per failed episode: `step`, `input_id`, `traj`,
`t`, `kind`, `message`, `traceback`; schema 4 stored only a count, its /tools rows `episode`
`reward_error`, read here as failures of kind "unknown"). `steps` and `metrics` hold only
current rows: rows a resume rolled back (schema 2: `superseded`=1; schema 1: all but the
last row of a step) are left out. Reads schema versions 1 to 6 (columns schema 1 lacks are absent; the
/samples columns of schema 6, `retokenized` and `prefill_len`, are 0 in an older file). Bad input
raises `AnalysisError` naming the file and what is wrong; files of another schema version
say which versions this code reads.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from flexmarl_hpc.analysis.episodes import calls_summary, failure_stats, tool_stats
from flexmarl_hpc.store.checksum import StoreDamaged, StoreUnreadable, open_read, read_rows, verify_store
from flexmarl_hpc.store.schema import ADDED, CONSUMED, DROPPED, EVAL_COLUMNS, EVENT_COLUMNS, INTERVAL_COLUMNS, FAILURE_COLUMNS, METRIC_COLUMNS, READS, SAMPLE_COLUMNS, STATUS_NAMES, STEP_COLUMNS, TOOL_COLUMNS, TOOL_OUTCOMES, episode_columns, eval_key, sample_columns

# the columns schema 1 had, where schema 2 added some
V1_ONLY = {"steps": [c for c in STEP_COLUMNS if c not in ("logp_mismatch", "tis_mean", "superseded", *ADDED)],
           "metrics": [c for c in METRIC_COLUMNS if c != "superseded"],
           "events": [c for c in EVENT_COLUMNS if c not in ("reward", "advantage")],
           "samples": list(sample_columns(1))}

BUSY = ("generate", "train", "sync", "swap", "checkpoint",
        "schedule", "handle", "store", "log")          # the last four: the orchestrator (rank 0)


class AnalysisError(Exception):
    """A run file cannot be analysed; the message names the file and the problem."""


@dataclass
class Run:
    path: Path
    attrs: dict
    config: dict
    samples: pd.DataFrame
    steps: pd.DataFrame
    intervals: pd.DataFrame
    metrics: pd.DataFrame
    events: pd.DataFrame
    agents: list[str] = field(default_factory=list)
    evals: pd.DataFrame = field(default_factory=pd.DataFrame)
    name: str = ""
    """How plots and tables name the run (`distinct_names`); default: the file's stem."""
    notice: str = ""
    """One line when its data cannot be verified (a store written without checksums)."""
    tools: pd.DataFrame = field(default_factory=lambda: _tools(None, []))
    episodes: pd.DataFrame = field(default_factory=lambda: _episodes(None, []))
    failures: pd.DataFrame = field(default_factory=lambda: _failures(None))

    @property
    def label(self) -> str:
        return f"{self.name or self.path.stem} ({self.attrs.get('mode', '?')})"


def distinct_names(paths: list[Path]) -> list[str]:
    """A name per run file that tells runs apart: the file's stem, with as many of its
    parent folders in front as it takes (runs/a/local.h5 and runs/b/local.h5 become a/local
    and b/local; the same file twice stays the same name)."""
    parts = [Path(p).resolve().with_suffix("").parts for p in paths]
    names = []
    for mine in parts:
        k = 1
        while k < len(mine) and any(o != mine and o[-k:] == mine[-k:] for o in parts):
            k += 1
        names.append("/".join(mine[-k:]))
    return names


def _columns_v1(f, group: str, columns: dict, path: Path) -> dict:
    """Schema 1: a group of equal-length 1-D datasets, one per column."""
    if group not in f:
        raise AnalysisError(f"{path}: missing dataset group /{group} (truncated or foreign file?)")
    g = f[group]
    data = {}
    for name in columns:
        if name not in g:
            raise AnalysisError(f"{path}: missing dataset /{group}/{name}")
        ds = g[name]
        ds.refresh() if hasattr(ds, "refresh") else None
        data[name] = ds[:]
    n = min(len(v) for v in data.values())         # a live writer may be mid-append
    return {k: v[:n] for k, v in data.items()}


def _columns_v2(f, name: str, columns: dict, path: Path, committed: dict, torn: list = ()) -> dict:
    """Schema 2: one compound dataset; only its committed rows (see /commit), a torn last
    chunk's from its bytes (read_rows)."""
    if name not in f:
        raise AnalysisError(f"{path}: missing dataset /{name} (truncated or foreign file?)")
    ds = f[name]
    ds.refresh() if hasattr(ds, "refresh") else None
    have = ds.dtype.names or ()
    missing = [c for c in columns if c not in have and c not in ADDED]
    if missing:
        raise AnalysisError(f"{path}: /{name} has no column {missing[0]}")
    rows = read_rows(ds, min(len(ds), committed.get("/" + name, len(ds))),
                     [d for d in torn if d.table == "/" + name])
    # a column added within schema 2 reads as NaN from a file written before it
    return {c: rows[c] if c in have else np.full(len(rows), np.nan, np.float32) for c in columns}


def _frame(data: dict) -> pd.DataFrame:
    return pd.DataFrame({k: np.char.decode(v, "utf-8") if v.dtype.kind == "S" else v
                         for k, v in data.items()})


def _current(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Rows a resume did not roll back: schema 2 marks the others superseded; schema 1 did
    not mark them, and the current row of a step is the last one written."""
    if "superseded" in df:
        return df[df["superseded"] == 0].reset_index(drop=True)
    return df.drop_duplicates(keys, keep="last").reset_index(drop=True)


def load_run(path: str | Path) -> Run:
    """Read one run file (a finished run or one still being written)."""
    import h5py
    path = Path(path)
    if not path.is_file():
        raise AnalysisError(f"{path}: no such file")
    try:
        f = open_read(path)
    except StoreUnreadable as e:
        raise AnalysisError(str(e)) from None
    with f:
        if f.attrs.get("program") != "flexmarl_hpc":
            raise AnalysisError(f"{path}: not a flexmarl_hpc run file (no program=flexmarl_hpc attribute)")
        version = int(f.attrs.get("schema_version", -1))
        if version not in READS:
            raise AnalysisError(f"{path}: schema version {version}; this flexmarl_hpc reads schema "
                                f"versions {', '.join(map(str, READS))} (use the flexmarl_hpc release that wrote it)")
        try:                        # every committed chunk, before a row of it is used
            notice = verify_store(f, path, torn=(torn := []))
        except StoreDamaged as e:
            raise AnalysisError(str(e)) from None
        attrs = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in f.attrs.items()}
        agents = [str(a) for a in attrs.get("agents", [])]
        try:
            if version == 1:
                def table(name, columns):
                    return _frame(_columns_v1(f, name, {c: t for c, t in columns.items()
                                                        if c in V1_ONLY.get(name.split("/")[0], columns)}, path))
            else:
                c = f["commit"]
                c.refresh() if hasattr(c, "refresh") else None
                committed = dict(zip((str(x) for x in c.attrs["tables"]), c[:].tolist()))

                def table(name, columns):
                    return _frame(_columns_v2(f, name, columns, path, committed, torn))
            samples = [_samples(table(f"samples/{a}", sample_columns(version)), a) for a in agents]
            steps = [_current(table(f"steps/{a}", STEP_COLUMNS), ["step"]).assign(agent=a) for a in agents]
            intervals = table("intervals", INTERVAL_COLUMNS)
            metrics = _current(table("metrics", METRIC_COLUMNS), ["step"])
            events = table("events", EVENT_COLUMNS)
            # /eval came later within schema 2: a file without it has no evaluation
            evals = table("eval", EVAL_COLUMNS) if version >= 2 and "eval" in f else pd.DataFrame()
            # schema 4 added /tools and /episodes: an older file has none (empty frames)
            tools = _tools(table("tools", TOOL_COLUMNS) if version >= 4 and "tools" in f else None, agents)
            episodes = _episodes(_columns_v2(f, "episodes", episode_columns(len(agents)), path, committed, torn)
                                 if version >= 4 and "episodes" in f else None, agents)
            failures = _failures(table("failures", FAILURE_COLUMNS) if version >= 5 else None, tools)
        except (KeyError, OSError, ValueError, RuntimeError) as e:
            raise AnalysisError(f"{path}: damaged file ({e})") from None
    try:
        config = yaml.safe_load(attrs.get("config_yaml", "")) or {}
    except yaml.YAMLError:
        config = {}
    events["agent"] = [agents[i] if 0 <= i < len(agents) else "?" for i in events["agent"]]
    return Run(path, attrs, config, pd.concat(samples, ignore_index=True) if samples else pd.DataFrame(),
               pd.concat(steps, ignore_index=True) if steps else pd.DataFrame(), intervals, metrics,
               events, agents, evals, notice=notice or "", tools=tools, episodes=episodes, failures=failures)


def _tools(df: pd.DataFrame | None, agents: list[str]) -> pd.DataFrame:
    """/tools with agents and outcomes by name (an empty frame of its columns for None)."""
    if df is None:
        return pd.DataFrame({c: pd.Series(dtype=object if c in ("agent", "tool", "outcome") else t)
                             for c, t in TOOL_COLUMNS.items()})
    df["agent"] = [agents[i] if 0 <= i < len(agents) else "" for i in df["agent"]]
    df["outcome"] = [TOOL_OUTCOMES[i] if 0 <= i < len(TOOL_OUTCOMES) else f"code {i}" for i in df["outcome"]]
    return df


def _episodes(data: dict | None, agents: list[str]) -> pd.DataFrame:
    """/episodes in long form: one row per (episode, agent) with that agent's calls and reward."""
    if data is None or not len(data["step"]):
        return pd.DataFrame({"step": pd.Series(dtype="i8"), "input_id": pd.Series(dtype="i8"),
                             "traj": pd.Series(dtype="i8"), "t": pd.Series(dtype="f8"),
                             "agent": pd.Series(dtype=object), "calls": pd.Series(dtype="i4"),
                             "reward": pd.Series(dtype="f4")})
    k = len(agents)
    out = {c: np.repeat(data[c], k) for c in ("step", "input_id", "traj", "t")}
    out["agent"] = np.tile(np.array(agents, object), len(data["step"]))
    out["calls"], out["reward"] = data["calls"].reshape(-1), data["reward"].reshape(-1)
    return pd.DataFrame(out)


def _failures(df: pd.DataFrame | None, tools: pd.DataFrame | None = None) -> pd.DataFrame:
    """/failures with its text decoded; before schema 5 (df None) the episodes the /tools rows
    `episode` `reward_error` counted, of kind "unknown" (their error was not stored)."""
    if df is None:
        old = tools[(tools["tool"] == "episode") & (tools["outcome"] == "reward_error")] \
            if tools is not None and len(tools) else tools
        n = 0 if old is None else len(old)
        get = (lambda c: old[c].to_numpy()) if n else (lambda c: np.zeros(0, "i8"))
        return pd.DataFrame({"t": get("t").astype("f8"), "step": np.full(n, -1, "i8"), "input_id": get("input_id"),
                             "traj": get("traj"), "kind": ["unknown"] * n, "message": [""] * n,
                             "traceback": [""] * n})
    for c in ("kind", "message", "traceback"):
        df[c] = [b.decode("utf-8", "replace") if isinstance(b, bytes) else str(b) for b in df[c]]
    return df


def _samples(df: pd.DataFrame, agent: str) -> pd.DataFrame:
    for c in SAMPLE_COLUMNS:            # added by a later schema (SAMPLE_SINCE): 0, as a fixed-turn sample has
        if c not in df:
            df[c] = np.zeros(len(df), SAMPLE_COLUMNS[c])
    df.insert(0, "agent", agent)
    df.insert(1, "row", np.arange(len(df)))
    df["status_name"] = df["status"].map(STATUS_NAMES)
    df["staleness"] = np.where(df["trainer_step"] >= 0, df["trainer_step"] - df["policy_version"], -1)
    return df


# ---------------------------------------------------------------------------------------
# Derived numbers (pure functions of a Run)
# ---------------------------------------------------------------------------------------
def wall_time(run: Run) -> float:
    if run.intervals.empty:
        return float(run.metrics["t"].max()) if not run.metrics.empty else 0.0
    return float(run.intervals["t1"].max() - run.intervals["t0"].min())


def utilization(run: Run, by: str = "role", bins: int | None = None) -> pd.DataFrame | dict:
    """Busy fraction: sum of busy time / (ranks x wall time), per role (or per rank).

    With `bins`, a DataFrame of the busy fraction per time bin (rows) and group (columns)."""
    iv = run.intervals
    if iv.empty:
        return {} if bins is None else pd.DataFrame()
    busy = iv[iv["activity"].isin(BUSY)]
    lo, hi = float(iv["t0"].min()), float(iv["t1"].max())
    ranks = iv.groupby(by)["rank"].nunique()
    if bins is None:
        secs = (busy["t1"] - busy["t0"]).groupby(busy[by]).sum()
        return {k: float(secs.get(k, 0.0) / (ranks[k] * (hi - lo))) for k in ranks.index}
    edges = np.linspace(lo, hi, bins + 1)
    out = {}
    for key, g in busy.groupby(by):
        t0, t1 = g["t0"].to_numpy(), g["t1"].to_numpy()
        cover = np.clip(np.minimum(t1[:, None], edges[1:]) - np.maximum(t0[:, None], edges[:-1]), 0, None)
        out[key] = cover.sum(0) / (ranks[key] * np.diff(edges))
    return pd.DataFrame(out, index=(edges[:-1] + edges[1:]) / 2)


def staleness(run: Run) -> pd.Series:
    """Count of consumed samples per staleness (versions between generation and training)."""
    s = run.samples
    return s.loc[s["staleness"] >= 0, "staleness"].value_counts().sort_index()


def config_digest(run: Run) -> str:
    return hashlib.sha256(str(run.attrs.get("config_yaml", "")).encode()).hexdigest()[:10]


def summary(run: Run) -> dict:
    """The numbers `analyze` prints, machine-readable."""
    wall = wall_time(run)
    steps = run.steps
    per_agent = {}
    for a in run.agents:
        r = steps.loc[steps["agent"] == a].sort_values("step")["reward_mean"]
        per_agent[a] = {"steps": int(len(r)),
                        "reward_first": float(r.iloc[0]) if len(r) else None,
                        "reward_last": float(r.iloc[-1]) if len(r) else None,
                        "reward_best": float(r.max()) if len(r) else None}
    consumed = run.samples[run.samples["status"] == CONSUMED] if not run.samples.empty else run.samples
    tokens = int((consumed["prompt_len"] + consumed["response_len"]).sum()) if len(consumed) else 0
    iv = run.intervals
    secs = (iv["t1"] - iv["t0"]).groupby(iv["activity"]).sum() if not iv.empty else pd.Series(dtype=float)
    return {
        "file": str(run.path), "config_digest": config_digest(run), "mode": run.attrs.get("mode"),
        "agents": run.agents, "steps_configured": steps_configured(run),
        "steps_done": int(steps.groupby("agent").size().min()) if not steps.empty else 0,
        "wall_s": wall, "samples": int(len(consumed)),
        "samples_dropped": int((run.samples["status"] == DROPPED).sum()) if not run.samples.empty else 0,
        "samples_per_s": len(consumed) / wall if wall > 0 else 0.0,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "per_agent": per_agent, "utilization": utilization(run),
        "staleness": {int(k): int(v) for k, v in staleness(run).items()},
        "sync_s": float(secs.get("sync", 0.0)), "swap_s": float(secs.get("swap", 0.0)),
        "eval": eval_curves(run),
        "calls_per_episode": calls_summary(run), "tools": tool_stats(run), "failures": failure_stats(run),
    }


def steps_configured(run: Run) -> int | None:
    """run.steps of the latest launch: the run folder's config.yaml (written at every launch,
    as `status` reads it) when it is beside the file and names the same run; else the file's
    own config, which is the first launch's (a resume with run.steps=44 keeps it at 20)."""
    steps = run.config.get("run", {}).get("steps")
    beside = run.path.parent / "config.yaml"
    try:
        latest = (yaml.safe_load(beside.read_text()) or {}).get("run", {}) if beside.is_file() else {}
    except (OSError, yaml.YAMLError, AttributeError):
        return steps
    same = latest.get("name") == run.config.get("run", {}).get("name")
    return int(latest["steps"]) if same and isinstance(latest.get("steps"), int) else steps


def eval_curves(run: Run) -> dict:
    """{key (store.eval_key): {"step": [...], "value": [...], "first", "last", "best", "n_inputs"}}."""
    out = {}
    ev = run.evals
    if ev.empty:
        return out
    for (agent, metric, mode), g in ev.groupby(["agent", "metric", "mode"], sort=False):
        g = g.sort_values("step")
        v = g["value"].astype(float)
        out[eval_key(agent, metric, mode)] = {
            "step": g["step"].astype(int).tolist(), "value": v.tolist(), "first": float(v.iloc[0]),
            "last": float(v.iloc[-1]), "best": float(v.max()), "n_inputs": int(g["n_inputs"].iloc[-1])}
    return out
