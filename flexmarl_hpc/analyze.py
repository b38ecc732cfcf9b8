"""Summarise and plot one or several runs from their HDF5 files.

    python -m flexmarl_hpc.analyze runs/local/local.h5                     # summary + figures
    python -m flexmarl_hpc.analyze runs/sync/local.h5 runs/flex/local.h5 --out figs/
    python -m flexmarl_hpc.analyze runs/local/local.h5 --json              # machine-readable
    python -m flexmarl_hpc.analyze salvage runs/local/local.h5 [--out NEW.h5]   # a damaged store
    python -m flexmarl_hpc.analyze runs/math_team/math_team.h5 --transcripts [--step N] [--agent A]
                                   [--worst K] [--html page.html]   # what the agents said

Figures (PNG, into --out, default `<first run's folder>/figures`): rewards.png,
entropy_kl.png, timeline.png (per-rank Gantt; per role and pool/group beyond 64 ranks), utilization.png, staleness.png,
response_lengths.png, replica_load.png, calls_per_episode.png (per agent, how many episodes
made how many calls: the skew; constant for a fixed-turn workflow), and eval.png (held-out
evaluation per step, when a run has /eval). Several runs are drawn side by side. A file that
is missing, truncated, of another program or of another schema version gives a one-line
message and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from flexmarl_hpc.analysis.episodes import calls_per_episode
from flexmarl_hpc.analysis.load import AnalysisError, Run, distinct_names, eval_curves, load_run, summary, utilization

ACTIVITY_COLORS = {"generate": "tab:blue", "train": "tab:orange", "sync": "tab:green",
                   "swap": "tab:purple", "checkpoint": "tab:brown", "wait": "0.85",
                   # the orchestrator's own row (rank 0)
                   "schedule": "tab:red", "handle": "tab:olive", "store": "tab:cyan", "log": "tab:pink"}
ZOOM_STEPS = 3                    # timeline: the right panel shows this many mid-run steps
MAX_BARS_PER_RANK = 4000          # Gantt: merge bars beyond this (keeps 1e6-sample files fast)
MAX_TIMELINE_RANKS = 64           # beyond: one timeline row per role and pool/group, not per rank


def print_summary(runs: list[Run], sums: list[dict]) -> None:
    for run, s in zip(runs, sums):
        print(f"== {run.path}  [{s['mode']}, config {s['config_digest']}, agents {', '.join(s['agents'])}]")
        print(f"   steps {s['steps_done']}/{s['steps_configured']}, wall {s['wall_s']:.1f} s, "
              f"{s['samples_per_s']:.1f} samples/s, {s['tokens_per_s']:.0f} tokens/s")
        fails = s["failures"]
        if s["samples_dropped"] > fails["calls_dropped"]:
            print(f"   dropped by over-provisioning: {s['samples_dropped'] - fails['calls_dropped']} samples "
                  f"(trained {s['samples']})")
        if fails["episodes"]:
            kinds = ", ".join(f"{k} {n}" for k, n in fails["by_kind"].items())
            print(f"   failed episodes: {fails['episodes']} ({kinds}); their calls dropped: {fails['calls_dropped']}")
            for k, msg in fails["first"].items():
                print(f"     first {k}: {' '.join(msg.split())[:200]}")
        for a, r in s["per_agent"].items():
            if r["steps"]:
                print(f"   {a:12s} reward first {r['reward_first']:.3f}  last {r['reward_last']:.3f}  "
                      f"best {r['reward_best']:.3f}")
        for k, e in s["eval"].items():
            print(f"   eval {k:24s} step {e['step'][0]} {e['first']:.3f} -> step {e['step'][-1]} "
                  f"{e['last']:.3f}  best {e['best']:.3f}  ({e['n_inputs']} held-out inputs)")
        util = ", ".join(f"{k} {v:.0%}" for k, v in s["utilization"].items())
        print(f"   utilization: {util}")
        total = sum(s["staleness"].values()) or 1
        stale = ", ".join(f"{k}: {v / total:.0%}" for k, v in s["staleness"].items())
        print(f"   staleness (versions): {stale}")
        print(f"   weight sync {s['sync_s']:.2f} s, state swap {s['swap_s']:.2f} s (summed over ranks)")
        _print_episodes(s)
    if len(runs) > 1:
        base = sums[0]
        print("\n   comparison vs " + runs[0].label)
        print(f"   {'run':32s} {'samples/s':>10s} {'x':>6s} {'wall s':>8s} {'util(all)':>9s}")
        for run, s in zip(runs, sums):
            u = np.mean(list(s["utilization"].values())) if s["utilization"] else 0.0
            x = s["samples_per_s"] / base["samples_per_s"] if base["samples_per_s"] else float("nan")
            print(f"   {run.label:32s} {s['samples_per_s']:10.1f} {x:6.2f} {s['wall_s']:8.1f} {u:9.0%}")


def _print_episodes(s: dict) -> None:
    """Calls per episode of each agent, and the tool calls by tool and outcome."""
    cpe = s["calls_per_episode"]
    for a, c in cpe["per_agent"].items():
        print(f"   calls/episode {a:12s} mean {c['mean']:.2f}  min {c['min']}  max {c['max']}  "
              f"({c['episodes']} episodes; {cpe['source']})")
    for tool, t in s["tools"].items():
        outcomes = ", ".join(f"{k} {v}" for k, v in t["outcomes"].items())
        print(f"   tool {tool:20s} {t['calls']} calls ({outcomes})  latency median "
              f"{t['latency_median_s']:.3f} s, p95 {t['latency_p95_s']:.3f} s")


STYLES = ["-", "--", ":", "-."]   # line style per run, when several are drawn side by side


def plot_all(runs: list[Run], out: Path) -> list[Path]:
    """Every figure of the runs, one PNG each in `out` (eval.png only when a run has /eval)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    figures = [("rewards.png", _rewards_figure), ("entropy_kl.png", _entropy_kl_figure),
               ("timeline.png", _timeline_figure), ("utilization.png", _utilization_figure),
               ("staleness.png", _staleness_figure), ("response_lengths.png", _lengths_figure),
               ("replica_load.png", _replica_load_figure), ("calls_per_episode.png", _calls_figure)]
    if any(not run.evals.empty for run in runs):
        figures.append(("eval.png", _eval_figure))
    files = []
    for name, draw in figures:
        fig = draw(plt, runs)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(out / name)
    return files


def _rewards_figure(plt, runs: list[Run]):
    """Mean reward of each step's samples per agent and run."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, run in enumerate(runs):
        for a in run.agents:
            st = run.steps[run.steps["agent"] == a].sort_values("step")
            ax.plot(st["step"], st["reward_mean"], STYLES[i % 4], label=f"{a} - {run.label}")
    ax.set(xlabel="optimizer step", ylabel="mean reward of the step's samples", title="Reward per agent")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def _entropy_kl_figure(plt, runs: list[Run]):
    """Policy entropy and KL to the initial policy per step, agent and run."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, run in enumerate(runs):
        for a in run.agents:
            st = run.steps[run.steps["agent"] == a].sort_values("step")
            axes[0].plot(st["step"], st["entropy"], STYLES[i % 4], label=f"{a} - {run.label}")
            axes[1].plot(st["step"], st["kl"], STYLES[i % 4], label=f"{a} - {run.label}")
    axes[0].set(xlabel="optimizer step", ylabel="mean token entropy (nats)", title="Policy entropy")
    axes[1].set(xlabel="optimizer step", ylabel="KL to initial policy (nats, k3)", title="KL")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return fig


def _timeline_figure(plt, runs: list[Run]):
    """Per run, the whole timeline (per rank, or per role and pool/group beyond
    MAX_TIMELINE_RANKS) and ZOOM_STEPS mid-run steps zoomed."""
    rows = max(len(_rows(r)) if _aggregated(r) else r.attrs.get("world_size", 4) for r in runs)
    fig, axes = plt.subplots(len(runs), 2, figsize=(14, 1.4 + 0.5 * min(rows, MAX_TIMELINE_RANKS) * len(runs)),
                             squeeze=False, gridspec_kw={"width_ratios": [3, 2]})
    for (ax, zoom), run in zip(axes, runs):
        draw = (lambda a, w, run=run: _band_gantt(a, run, w)) if _aggregated(run) else (
            lambda a, w, run=run: _gantt(a, run.intervals, w))
        draw(ax, None)
        ax.set_title(f"{'Per-pool/group' if _aggregated(run) else 'Per-rank'} timeline - {run.label}", fontsize=9)
        window = _mid_steps(run, ZOOM_STEPS)
        if window is not None:
            draw(zoom, window)
            zoom.set_title(f"steps {window[2]}-{window[2] + ZOOM_STEPS - 1}, zoomed", fontsize=9)
            ax.axvspan(window[0], window[1], color="k", alpha=0.15, lw=0)
        else:
            zoom.set_axis_off()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ACTIVITY_COLORS.values()]
    axes[0, 0].legend(handles, ACTIVITY_COLORS.keys(), ncol=10, fontsize=7, loc="lower left",
                      bbox_to_anchor=(0.0, 1.12))
    return fig


def _utilization_figure(plt, runs: list[Run]):
    """Busy share of each role's ranks over time, one panel per run."""
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4), squeeze=False)
    for ax, run in zip(axes[0], runs):
        u = utilization(run, by="role", bins=60)
        for col in u.columns:
            ax.plot(u.index, 100 * u[col], label=col)
        ax.set(xlabel="time since start (s)", ylabel="busy (% of the role's ranks)", ylim=(0, 105),
               title=f"Utilization by role - {run.label}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return fig


def _staleness_figure(plt, runs: list[Run]):
    """How many policy versions behind the trainer the trained samples were."""
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        s = run.samples[run.samples["staleness"] >= 0]["staleness"].value_counts().sort_index()
        ax.bar(s.index + i * width, s.values, width=width, label=run.label)
    ax.set(xlabel="staleness (policy versions behind the trainer)", ylabel="consumed samples",
           title="Staleness of trained samples")
    ax.legend(fontsize=8)
    return fig


def _lengths_figure(plt, runs: list[Run]):
    """Histogram of response lengths per agent, a line per run."""
    agents = sorted({a for r in runs for a in r.agents})
    fig, axes = plt.subplots(1, len(agents), figsize=(4.5 * len(agents), 3.8), squeeze=False)
    for ax, a in zip(axes[0], agents):
        for run in runs:
            L = run.samples.loc[run.samples["agent"] == a, "response_len"].to_numpy()
            if len(L):
                ax.hist(L, bins=np.arange(0, L.max() + 2) - 0.5 if L.max() < 60 else 40,
                        histtype="step", lw=1.5, label=run.label)
        ax.set(xlabel="response length (tokens)", ylabel="samples", title=f"Response lengths - {a}")
        ax.legend(fontsize=7)
    return fig


def _replica_load_figure(plt, runs: list[Run]):
    """Per rollout replica, when it generated and for which agent."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.5 + 0.6 * max(
        r.attrs.get("world_size", 4) for r in runs) * len(runs)), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, run in zip(axes[:, 0], runs):
        gen = run.intervals[(run.intervals["role"] == "rollout") & (run.intervals["activity"] == "generate")]
        colors = {a: cmap(i % 10) for i, a in enumerate(run.agents)}
        reps = sorted(gen["rank"].unique())
        for rank, g in gen.groupby("rank"):
            for a, ga in g.groupby("agent"):
                ax.broken_barh(_merge(ga["t0"].to_numpy(), ga["t1"].to_numpy()), (rank - 0.4, 0.8),
                               color=colors.get(a, "k"), lw=0)
        ax.set_yticks(reps, [f"replica rank {r}" for r in reps], fontsize=7)
        ax.set(xlabel="time since start (s)", title=f"Rollout replica load (agent served) - {run.label}")
        ax.legend([plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()], colors.keys(),
                  fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(colors))
    return fig


def _calls_figure(plt, runs: list[Run]):
    """Per agent, how many episodes made how many calls of it; bars side by side per run."""
    agents = list(dict.fromkeys(a for r in runs for a in r.agents))      # the workflow's order
    fig, axes = plt.subplots(1, max(len(agents), 1), figsize=(4.5 * max(len(agents), 1), 3.8), squeeze=False)
    data = [calls_per_episode(run) for run in runs]
    width = 0.8 / len(runs)
    for ax, a in zip(axes[0], agents):
        for i, (run, (calls, source)) in enumerate(zip(runs, data)):
            h = calls.loc[calls["agent"] == a, "calls"].astype(int).value_counts().sort_index()
            ax.bar(h.index + (i - (len(runs) - 1) / 2) * width, h.values, width=width,
                   label=f"{run.label} ({source})")
        ax.set(xlabel="calls of the agent in one episode", ylabel="episodes", title=f"Calls per episode - {a}")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=7)
    return fig


def _eval_figure(plt, runs: list[Run]):
    """Held-out evaluation per step: one line per (agent, metric, mode) and run."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, run in enumerate(runs):
        for key, e in eval_curves(run).items():
            ax.plot(e["step"], e["value"], STYLES[i % 4], marker="o", ms=3, label=f"{key} - {run.label}")
    ax.set(xlabel="optimizer step (policy version evaluated)", ylabel="mean over held-out inputs",
           title="Held-out evaluation")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def _gantt(ax, iv, window: tuple | None) -> None:
    """One row per rank (the orchestrator, rank 0, included), waits under busy bars."""
    if window is not None:
        iv = iv[(iv["t1"] > window[0]) & (iv["t0"] < window[1])]
    for rank, g in iv.groupby("rank"):
        for act, ga in sorted(g.groupby("activity"), key=lambda kv: kv[0] != "wait"):
            bars = _merge(ga["t0"].to_numpy(), ga["t1"].to_numpy())
            ax.broken_barh(bars, (rank - 0.4, 0.8), color=ACTIVITY_COLORS.get(act, "k"), lw=0)
    ranks = sorted(iv["rank"].unique())
    roles = iv.groupby("rank")["role"].first()
    ax.set_yticks(ranks, [f"{r} {roles[r]}" for r in ranks], fontsize=7)
    ax.set_xlabel("time since start (s)")
    if window is not None:
        ax.set_xlim(window[0], window[1])


def _aggregated(run: Run) -> bool:
    return int(run.attrs.get("world_size", 0)) > MAX_TIMELINE_RANKS


def _rows(run: Run) -> list[tuple[str, list[int]]]:
    """(label, world ranks) per timeline row of a large run: the orchestrator, each rollout
    pool, each trainer group (from the run's config, in the layout's rank order)."""
    ro, tr = run.config.get("rollout", {}), run.config.get("trainer", {})
    pools = [(p.get("name") or f"pool{i}", int(p["replicas"])) for i, p in enumerate(ro.get("pools") or [])] \
        or [("rollout", int(ro.get("replicas", 1)))]
    groups = [(g.get("name") or f"group{i}", int(g["ranks"])) for i, g in enumerate(tr.get("named_groups") or [])]
    if not groups:
        n = int(run.attrs.get("world_size", 1)) - 1 - sum(k for _, k in pools)
        per = max(int(tr.get("ranks_per_group", 1)), 1)
        groups = [(f"group{i}", per) for i in range(max(n // per, 0))]
    out, r = [("orchestrator", [0])], 1
    for kind, items in (("pool", pools), ("group", groups)):
        for name, k in items:
            out.append((f"{kind} {name} ({k})", list(range(r, r + k))))
            r += k
    return out


def _band_gantt(ax, run: Run, window: tuple | None, bins: int = 600) -> None:
    """One row per role and pool/group (for runs of more than MAX_TIMELINE_RANKS ranks): per
    activity, the fraction of the row's ranks busy with it, stacked inside the row's band."""
    iv = run.intervals
    if iv.empty:
        return
    lo, hi = (window[0], window[1]) if window else (float(iv["t0"].min()), float(iv["t1"].max()))
    t = np.linspace(lo, hi, bins)
    rows = _rows(run)
    for y, (label, ranks) in enumerate(rows):
        g = iv[iv["rank"].isin(ranks) & (iv["activity"] != "wait")]
        base = np.zeros(bins)
        for act, ga in g.groupby("activity"):
            t0, t1 = np.sort(ga["t0"].to_numpy()), np.sort(ga["t1"].to_numpy())
            frac = (np.searchsorted(t0, t, "right") - np.searchsorted(t1, t, "right")) / len(ranks)
            top = base + 0.8 * np.clip(frac, 0, 1)
            ax.fill_between(t, y - 0.4 + base, y - 0.4 + top, color=ACTIVITY_COLORS.get(act, "k"), lw=0,
                            label=act if y == len(rows) - 1 else None)
            base = top
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=7)
    ax.set_xlabel("time since start (s); band height = share of the row's ranks busy")
    ax.set_xlim(lo, hi)


def _mid_steps(run: Run, k: int) -> tuple[float, float, int] | None:
    """(t0, t1, first step) of k consecutive global steps in the middle of the run."""
    m = run.metrics
    if m.empty or len(m) < k + 2:
        return None
    t = m.sort_values("step")["t"].to_numpy()
    i = len(t) // 2
    return float(t[i - 1]), float(t[i - 1 + k]), i + 1


def _merge(t0: np.ndarray, t1: np.ndarray) -> list[tuple[float, float]]:
    """(start, width) bars; beyond MAX_BARS_PER_RANK neighbours closer than a pixel merge."""
    order = np.argsort(t0)
    t0, t1 = t0[order], t1[order]
    if len(t0) > MAX_BARS_PER_RANK:
        gap = (t1.max() - t0.min()) / MAX_BARS_PER_RANK
        starts = np.r_[True, t0[1:] - t1[:-1] > gap]
        idx = np.flatnonzero(starts)
        ends = np.maximum.reduceat(t1, idx)
        t0, t1 = t0[idx], ends
    return list(zip(t0.tolist(), (t1 - t0).tolist()))


def salvage_main(argv: list[str]) -> int:
    """`analyze salvage RUN.h5 [--out NEW.h5]`: flexmarl_hpc.store.salvage, one line each of
    what was lost; rc 2 (one line) where it cannot."""
    from flexmarl_hpc.store.salvage import salvage
    ap = argparse.ArgumentParser(prog="python -m flexmarl_hpc.analyze salvage",
                                 description="copy every verifiable committed row of a damaged "
                                             "store into a new one (docs/store.md)")
    ap.add_argument("file", type=Path, help="the damaged run HDF5 file (only read)")
    ap.add_argument("--out", type=Path, help="the new store (default: RUN.salvaged.h5 beside it)")
    a = ap.parse_args(argv)
    out = a.out or a.file.with_suffix(".salvaged.h5")
    try:
        rep = salvage(a.file, out)
    except (OSError, ValueError, KeyError) as e:
        print(f"analyze salvage: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print("\n".join(rep.lines()))
    return 0


def _transcripts(a) -> int:
    from flexmarl_hpc.analysis.transcripts import transcripts_main
    if len(a.files) != 1 or (a.worst is not None and a.worst < 1):
        print("analyze: --transcripts: expected one run file (and --worst K with K >= 1)", file=sys.stderr)
        return 2
    try:
        print(transcripts_main(load_run(a.files[0]), a.step, a.agent, a.worst, a.tokenizer, a.html))
    except AnalysisError as e:
        print(f"analyze: {e}", file=sys.stderr)
        return 2
    if a.html:
        print(f"page: {a.html}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["salvage"]:
        return salvage_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m flexmarl_hpc.analyze", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path, help="run HDF5 files")
    ap.add_argument("--out", type=Path, help="figure folder (default: <first file's folder>/figures)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON, no figures")
    ap.add_argument("--no-plots", action="store_true", help="summary only")
    ap.add_argument("--transcripts", action="store_true",
                    help="print the episodes as conversations (analysis/transcripts.py), no summary")
    ap.add_argument("--step", type=int, help="--transcripts: only this step's episodes")
    ap.add_argument("--agent", help="--transcripts: episodes where this agent was called (--worst: by its rewards)")
    ap.add_argument("--worst", type=int, help="--transcripts: the K episodes of lowest mean reward")
    ap.add_argument("--html", type=Path, help="--transcripts: also write them as one HTML page")
    ap.add_argument("--tokenizer", help="--transcripts: decode with this checkpoint folder, not the run's")
    a = ap.parse_args(argv)
    if a.transcripts:
        return _transcripts(a)
    runs, sums = [], []
    names = distinct_names(a.files)                 # runs of one name: their folders tell them apart
    for p, name in zip(a.files, names):
        try:
            runs.append(load_run(p))
            runs[-1].name = name
            if runs[-1].notice:
                print(f"analyze: {runs[-1].notice}", file=sys.stderr)
            sums.append(summary(runs[-1]))
        except AnalysisError as e:
            print(f"analyze: {e}", file=sys.stderr)
            return 2
        except (OSError, KeyError, ValueError, IndexError, RuntimeError) as e:
            # h5py/pandas on a damaged file: still one line naming it, never a traceback
            print(f"analyze: {p}: damaged or unreadable run file ({type(e).__name__}: "
                  f"{str(e).splitlines()[0] if str(e) else ''})", file=sys.stderr)
            return 2
    if a.json:
        print(json.dumps(sums if len(sums) > 1 else sums[0], indent=2))
        return 0
    print_summary(runs, sums)
    if not a.no_plots:
        files = plot_all(runs, a.out or a.files[0].parent / "figures")
        print(f"\nfigures: {', '.join(str(f) for f in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
