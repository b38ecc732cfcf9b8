"""Greedy held-out evaluation of a run's agents from its checkpoints (or of the base model),
outside the training run: every agent answers each of the task's `heldout_inputs(n)` once,
greedily, through the workflow's turns, and `task.eval_metrics` scores the leaves.

    python scripts/eval_heldout.py configs/smollm2_learn.yaml -n 128            # zero-shot
    python scripts/eval_heldout.py runs/smollm2_learn -n 128 --all --json out.json
    python scripts/eval_heldout.py --plot out.json docs/smollm2_learn.png   # the curve

With a run directory it evaluates its latest checkpoint (or every kept one with --all),
each agent at the same version. Prints mean metrics with their binomial standard error.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path as FsPath

import torch

from flexmarl_hpc.build import build_task
from flexmarl_hpc.checkpoint import committed_versions
from flexmarl_hpc.config import load_config
from flexmarl_hpc.model import load_hf_checkpoint
from flexmarl_hpc.sampling import SamplingParams, generate
from flexmarl_hpc.workflows.base import Path

GREEDY = SamplingParams(temperature=1.0, top_p=1e-9)     # top_p keeps only the top token


def evaluate(task, models: dict, turns, n: int, batch: int = 64) -> dict[str, float]:
    """Mean eval metrics over n held-out inputs, one greedy sample per turn."""
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
    rows = [task.eval_metrics(p) for p in paths]
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def load_agents(cfg, run_dir: FsPath | None, version: int | None) -> dict:
    models = {}
    for agent in cfg.agent_names:
        m = load_hf_checkpoint(cfg.model_for(agent).checkpoint)
        if version is not None:
            state = torch.load(run_dir / "checkpoints" / agent / f"v{version:06d}.pt", weights_only=True)
            m.load_state_dict({k[6:]: v for k, v in state.items() if k.startswith("model.")}, strict=False)
        models[agent] = m.eval()
    return models


def plot(rows_file: str, png: str) -> None:
    """Held-out metrics per policy version (version 0: the base model), ±1 binomial std err."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = sorted((json.loads(x) for x in open(rows_file) if x.strip()), key=lambda r: r["version"])
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for key in [k for k in rows[0] if k not in ("version", "n")]:
        v = [r["version"] for r in rows]
        y = [r[key] for r in rows]
        e = [math.sqrt(x * (1 - x) / r["n"]) for x, r in zip(y, rows)]
        ax.errorbar(v, y, yerr=e, marker="o", capsize=3, label=key)
    ax.set_xlabel("policy version (training step)")
    ax.set_ylabel(f"held-out mean, greedy (n={rows[0]['n']})")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", nargs="?", help="a config YAML (base model) or a run directory")
    ap.add_argument("--plot", nargs=2, metavar=("JSONL", "PNG"), help="plot the recorded rows and exit")
    ap.add_argument("-n", type=int, default=128, help="held-out inputs")
    ap.add_argument("--all", action="store_true", help="every kept checkpoint, not only the latest")
    ap.add_argument("--json", help="append one JSON line per evaluated version to this file")
    a = ap.parse_args(argv)
    if a.plot:
        plot(*a.plot)
        return 0
    if not a.source:
        ap.error("a config YAML or a run directory is needed")
    torch.set_num_threads(1)
    src = FsPath(a.source)
    run_dir = src if src.is_dir() else None
    cfg = load_config(src / "config.yaml" if run_dir else src)
    task = build_task(cfg)
    versions = [None]
    if run_dir:
        kept = [v for v in committed_versions(run_dir / "checkpoints" / cfg.agent_names[0])
                if all((run_dir / "checkpoints" / ag / f"v{v:06d}.pt").is_file() for ag in cfg.agent_names)]
        versions = kept if a.all else kept[-1:]
    for v in versions:
        t0 = time.time()
        res = evaluate(task, load_agents(cfg, run_dir, v), cfg.workflow.turns, a.n)
        err = {k: math.sqrt(x * (1 - x) / a.n) for k, x in res.items()}
        print(f"version {v if v is not None else 'base'}: n={a.n} " +
              "  ".join(f"{k} {x:.3f}±{err[k]:.3f}" for k, x in res.items()) + f"  ({time.time() - t0:.0f}s)")
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps({"version": v or 0, "n": a.n, **res}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
