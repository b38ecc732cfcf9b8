"""Greedy held-out evaluation of a run's agents from its checkpoints (or of the base model),
outside the training run: every agent answers each of the task's `heldout_inputs(n)` once,
greedily, through the workflow's turns, and `task.eval_metrics` scores the leaves.

    python scripts/eval_heldout.py configs/smollm2_learn.yaml -n 128            # zero-shot
    python scripts/eval_heldout.py runs/smollm2_learn -n 128 --all --json out.json
    python scripts/eval_heldout.py runs/smollm2_learn -n 121 --all --paired   # + flips vs the base
    python scripts/eval_heldout.py --plot out.json docs/smollm2_learn_eval.png   # the curve
    python scripts/eval_heldout.py --plot curve.jsonl docs/math_team_heldout.png --keys team_correct
    python scripts/eval_heldout.py runs/math_team -n 200 --paired            # an episode workflow
    python scripts/eval_heldout.py runs/math_team -n 200 --paired --rows runs/math_team/eval
    python scripts/eval_heldout.py runs/math_team -n 200 --rows runs/math_team/eval --only 14

An episode workflow (workflow.episode) runs one greedy episode per held-out example of
workflow.dataset.eval (workflows/offline.py) and averages what the episodes put in
ctx.metrics.

With a run directory it evaluates its latest checkpoint (or every kept one with --all; torch
files or megatron dist_checkpointing folders), each agent at the same version. Prints mean
metrics with their binomial standard error. --paired also evaluates the base model and, per
metric, counts the held-out inputs each version turned from wrong to right and from right
to wrong, with the two-sided sign-test p-value of those flips: the same inputs scored
twice, so a gain that the unpaired standard errors leave in doubt can still be told from
noise.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path as FsPath

import torch

from flexmarl_hpc.analysis.paired import sign_test
from flexmarl_hpc.workflows.build import build_task
from flexmarl_hpc.store.checkpoint import committed_versions, replace_file
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.export import checkpoint_file, load_agent
from flexmarl_hpc.learn.model import load_hf_checkpoint
from flexmarl_hpc.learn.sampling import SamplingParams, generate
from flexmarl_hpc.workflows.base import Path

GREEDY = SamplingParams(temperature=1.0, top_p=1e-9)     # top_p keeps only the top token


def evaluate(task, models: dict, turns, n: int, batch: int = 64) -> list[dict[str, float]]:
    """Eval metrics of each of n held-out inputs, one greedy sample per turn."""
    paths = [Path(x) for x in task.heldout_inputs(n)]
    for t, turn in enumerate(turns):
        nxt = []
        for i in range(0, len(paths), batch):
            chunk = paths[i:i + batch]
            gens = generate(models[turn.agent], [task.prompt(t, p) for p in chunk], [0] * len(chunk),
                            [turn.max_new_tokens] * len(chunk), GREEDY, task.vocab.pad_id,
                            task.stop_tokens, [task.allowed_tokens(t)] * len(chunk))
            nxt += [Path(p.input, p.responses + (tuple(g.tokens),)) for p, g in zip(chunk, gens)]
        paths = nxt
    return [task.eval_metrics(p) for p in paths]


def evaluate_episodes(cfg, task, models: dict, n: int) -> list[dict[str, float]]:
    """Episode workflows: ctx.metrics of one greedy episode per held-out example (an episode
    that failed scores 0 on every metric the others report)."""
    from flexmarl_hpc.tools.pool import WorkerPool
    from flexmarl_hpc.tools.registry import Tools
    from flexmarl_hpc.workflows.offline import run_episodes
    done = run_episodes(task, cfg, models, task.stream.heldout(n), tools=WorkerPool(Tools.from_config(cfg.tools), cfg.tools))
    keys = sorted({k for f in done for k in f.ctx.metrics})
    return [{k: float(f.ctx.metrics.get(k, 0.0)) for k in keys} for f in done]


def mean(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def std_err(rows: list[dict[str, float]]) -> dict[str, float]:
    """Standard error of each metric's mean (the binomial one for a 0/1 metric; a count such
    as math_team's `solvers` is not 0/1)."""
    m = mean(rows)
    return {k: math.sqrt(sum((r[k] - x) ** 2 for r in rows) / len(rows) / len(rows)) for k, x in m.items()}


def flips(base: list[dict[str, float]], rows: list[dict[str, float]]) -> str:
    """Per 0/1 metric: inputs turned wrong -> right (+) and right -> wrong (-), and p."""
    out = []
    for k in rows[0]:
        up = sum(b[k] < r[k] for b, r in zip(base, rows))
        down = sum(b[k] > r[k] for b, r in zip(base, rows))
        out.append(f"{k} +{up}/-{down} (p={sign_test(up, down):.3g})")
    return "  ".join(out)


def cached_rows(path: FsPath | None, n: int) -> list[dict[str, float]] | None:
    """A version's per-input scores kept by an earlier --rows run with the same n."""
    if path is None or not path.exists():
        return None
    kept = json.loads(path.read_text())
    return kept["rows"] if kept.get("n") == n else None


def load_agents(cfg, task, run_dir: FsPath | None, version: int | None) -> dict:
    if version is None:
        return {a: load_hf_checkpoint(cfg.model_for(a).checkpoint).eval() for a in cfg.agent_names}
    return {a: load_agent(run_dir, cfg, task, a, version)[0].eval() for a in cfg.agent_names}


def kept_versions(run_dir: FsPath, agents: list[str]) -> list[int]:
    """Versions every agent has a committed checkpoint of (file or folder)."""
    def has(agent: str, v: int) -> bool:
        try:
            return checkpoint_file(run_dir, agent, v).exists()
        except FileNotFoundError:
            return False
    return [v for v in committed_versions(run_dir / "checkpoints" / agents[0]) if all(has(a, v) for a in agents)]


def plot(rows_file: str, png: str, keys: list[str] | None = None) -> None:
    """Held-out metrics per policy version (version 0: the base model), ±1 std err; `keys`:
    only these metrics (a count such as math_team's solvers is off the 0-1 axis)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = sorted((json.loads(x) for x in open(rows_file) if x.strip()), key=lambda r: r["version"])
    fig, ax = plt.subplots(figsize=(6, 3.6))
    metrics = [k for k in rows[0] if k not in ("version", "n", "std_err")]
    missing = sorted(set(keys or ()) - set(metrics))
    if missing:
        raise SystemExit(f"{rows_file}: no metric {missing} (it has {metrics})")
    for key in keys or metrics:
        v = [r["version"] for r in rows]
        y = [r[key] for r in rows]
        # std_err written with the row (a count is not 0/1); older lines: the binomial one
        e = [r["std_err"][key] if "std_err" in r else math.sqrt(x * (1 - x) / r["n"]) for x, r in zip(y, rows)]
        ax.errorbar(v, y, yerr=e, marker="o", capsize=3, label=key)
    ax.set_xlabel("policy version (training step)")
    ax.set_ylabel(f"held-out mean, greedy (n={rows[0]['n']})")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def only_choice(text: str) -> str | int:
    """--only: `base`, `latest` or a version number."""
    if text in ("base", "latest"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected base, latest or a version number, got {text!r}") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", nargs="?", help="a config YAML (base model) or a run directory")
    ap.add_argument("--plot", nargs=2, metavar=("JSONL", "PNG"), help="plot the recorded rows and exit")
    ap.add_argument("--keys", nargs="+", help="with --plot: only these metrics")
    ap.add_argument("-n", type=int, default=128, help="held-out inputs")
    ap.add_argument("--all", action="store_true", help="every kept checkpoint, not only the latest")
    ap.add_argument("--json", help="append one JSON line per evaluated version to this file")
    ap.add_argument("--paired", action="store_true", help="also the base model, and each version's "
                    "flips against it per input with a sign test")
    ap.add_argument("--rows", type=FsPath, help="a folder of per-input scores per version: read "
                    "from it when it holds -n of them, else evaluated and written there")
    ap.add_argument("--only", type=only_choice, help="evaluate only the base model, only the run's latest "
                    "checkpoint, or only kept version N: base, latest or N (with --rows: for processes "
                    "at once, one version each)")
    a = ap.parse_args(argv)
    if a.plot:
        plot(*a.plot, keys=a.keys)
        return 0
    if not a.source:
        ap.error("a config YAML or a run directory is needed")
    torch.set_num_threads(1)
    src = FsPath(a.source)
    run_dir = src if src.is_dir() else None
    try:
        cfg = load_config(src / "config.yaml" if run_dir else src)
    except ConfigError as e:               # relative paths in it are read from the working folder
        print(f"{a.source}: {e}")
        return 2
    task = build_task(cfg)
    versions: list[int | None] = [None]
    if run_dir:
        kept = kept_versions(run_dir, cfg.agent_names)
        if not kept:
            print(f"{run_dir / 'checkpoints'}: no checkpoint that every agent has")
            return 2
        versions = ([None] if a.paired else []) + (kept if a.all else kept[-1:])
    if a.only == "base":
        versions = [None]
    elif a.only is not None:
        if not run_dir or (a.only != "latest" and a.only not in kept):
            print(f"--only {a.only}: no such kept version in {a.source}" + (f" (kept: {kept})" if run_dir else ""))
            return 2
        versions = [kept[-1] if a.only == "latest" else a.only]
    base = None
    for v in versions:
        t0 = time.time()
        kept_rows = a.rows / ("base.json" if v is None else f"v{v}.json") if a.rows else None
        rows = cached_rows(kept_rows, a.n)
        if rows is None:
            models = load_agents(cfg, task, run_dir, v)
            rows = evaluate_episodes(cfg, task, models, a.n) if cfg.workflow.episode else \
                evaluate(task, models, cfg.workflow.turns, a.n)
            if kept_rows:
                kept_rows.parent.mkdir(parents=True, exist_ok=True)
                replace_file(kept_rows, json.dumps({"n": a.n, "rows": rows}).encode())
        res = mean(rows)
        base = rows if v is None else base
        err = std_err(rows)
        print(f"version {v if v is not None else 'base'}: n={a.n} " +
              "  ".join(f"{k} {x:.3f}±{err[k]:.3f}" for k, x in res.items()) + f"  ({time.time() - t0:.0f}s)")
        if a.paired and v is not None and base is not None:
            print(f"  vs base: {flips(base, rows)}")
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps({"version": v or 0, "n": a.n, **res, "std_err": err}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
