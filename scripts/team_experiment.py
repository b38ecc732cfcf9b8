"""The team experiment (issue 40): base team vs trained team vs a single solver trained alone
at the same compute, paired on one held-out set disjoint from training by construction.

    PYTHONPATH=$PWD nice -n 15 .venv/bin/python scripts/team_experiment.py --steps 4 -n 200
    PYTHONPATH=$PWD .venv/bin/python scripts/team_experiment.py --steps 4 -n 200 --report-only  # what is done so far

1. Data (out/data): training problems from the templates of wordproblems.py that are not
   HELDOUT_TEMPLATES, held-out ones from those only, none stating a training problem's numbers
   (`split_by_template`); `check_disjoint` then re-reads both files and counts shared
   questions, templates and number tuples (all must be 0, else rc 1).
2. The team (configs/math_team.yaml: planner, solvers, verifier; every solver thread's first
   reply a forced calculator call) trains --steps steps. Then one solver alone
   (math_team:single, same model, prompt, calculator and rewards) trains the same number of
   steps with its episodes per step scaled so that the response tokens it samples match the
   team's: episodes x (team tokens per episode / tokens per solver thread), both measured from
   the team's store; the two runs' measured totals are printed (their ratio - 1).
3. scripts/eval_heldout.py scores base team, trained team and trained single, greedy, on the
   same first n held-out problems (per-problem rows kept in out/eval*: a rerun reuses them).
4. Per pair: wins/losses/ties of team_correct and the exact two-sided sign test; calculator
   calls per episode (ok and refused, from each store's /tools joined to /episodes) per step,
   and at evaluation; the plot (docs/team_experiment.png). Runs and evaluations already done
   are not redone.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from flexmarl_hpc.analysis.paired import sign_test

ROOT = Path(__file__).resolve().parents[1]
EPISODE_ARGS = "{extra_solver_cost: 0.02, force_calculator: true}"


# ---------------------------------------------------------------------------------------
# Pure parts (tests/unit/test_team_experiment.py)
# ---------------------------------------------------------------------------------------
def flips(a: list[float], b: list[float]) -> tuple[int, int, int]:
    """Paired 0/1 scores: (a right where b wrong, b right where a wrong, same)."""
    if len(a) != len(b):
        raise ValueError(f"paired scores of different lengths: {len(a)} and {len(b)}")
    wins = sum(x > y for x, y in zip(a, b))
    losses = sum(x < y for x, y in zip(a, b))
    return wins, losses, len(a) - wins - losses


def check_disjoint(train: list[dict], heldout: list[dict]) -> dict[str, int]:
    """How many held-out rows share with training their question, template or numbers (the
    integers the question states, in order); all 0 for a disjoint set."""
    from flexmarl_hpc.workflows.wordproblems import numbers
    questions = {r["question"] for r in train}
    templates = {r["template"] for r in train}
    nums = {numbers(r["question"]) for r in train}
    return {"same question": sum(r["question"] in questions for r in heldout),
            "same template": sum(r["template"] in templates for r in heldout),
            "same numbers": sum(numbers(r["question"]) in nums for r in heldout)}


def calls_per_step(episodes: list[tuple[int, int, int]], calls: list[tuple[int, int, str]]) -> dict[int, dict]:
    """Calculator calls per episode by training step. episodes: (step, input_id, traj) of
    /episodes; calls: (input_id, traj, outcome) of /tools' calculator rows."""
    step_of = {(i, t): s for s, i, t in episodes}
    per = Counter(s for s, _, _ in episodes)
    ok, bad = Counter(), Counter()
    for i, t, outcome in calls:
        if (i, t) in step_of:
            (ok if outcome == "ok" else bad)[step_of[i, t]] += 1
    return {s: {"episodes": per[s], "ok": ok[s] / per[s], "refused": bad[s] / per[s]} for s in sorted(per)}


# ---------------------------------------------------------------------------------------
# The shell: data, runs, evaluations, report
# ---------------------------------------------------------------------------------------
def write_data(out: Path, seed: int, n_train: int, n_eval: int) -> tuple[list[dict], list[dict]]:
    from flexmarl_hpc.workflows.wordproblems import split_by_template
    train, heldout = split_by_template(seed, n_train, n_eval, max_steps=2)
    out.mkdir(parents=True, exist_ok=True)
    for name, ps in (("train", train), ("heldout", heldout)):
        text, path = "".join(json.dumps({**p.row(), "template": p.template}) + "\n" for p in ps), out / f"{name}.jsonl"
        if not path.exists() or path.read_text() != text:       # a run reading it is left alone
            path.write_text(text)
    return [json.loads(x) for x in open(out / "train.jsonl")], [json.loads(x) for x in open(out / "heldout.jsonl")]


def overrides(out: Path, name: str, steps: int, inputs: int, max_new: int) -> list[str]:
    return [f"run.name={name}", f"run.output_dir={out / name}", f"run.steps={steps}",
            f"run.checkpoint_every={steps}", "run.keep_checkpoints=1",
            f"workflow.dataset.train={out / 'data/train.jsonl'}", f"workflow.dataset.eval={out / 'data/heldout.jsonl'}",
            f"workflow.episode_args={EPISODE_ARGS}", f"workflow.inputs_per_step={inputs}",
            f"workflow.max_new_tokens={max_new}"]


SINGLE = ["workflow.episode=flexmarl_hpc.workflows.math_team:single", "workflow.agents=[solver]"]


def trained(run: Path, steps: int) -> bool:
    from flexmarl_hpc.store.checkpoint import committed_versions
    return (run / "checkpoints" / "solver").exists() and steps in committed_versions(run / "checkpoints" / "solver")


def train(out: Path, name: str, args: list[str], steps: int, launch: bool = True) -> Path | None:
    """The run folder once it holds version `steps` (trained now unless `launch` is off: None)."""
    run = out / name
    if trained(run, steps):
        print(f"[team] {run}: trained already, kept")
        return run
    if not launch:
        print(f"[team] {run}: not trained to step {steps} yet" + ("" if (run / f"{name}.h5").exists() else ", no store"))
        return None
    cmd = [sys.executable, "-m", "flexmarl_hpc.run", "configs/math_team.yaml", *args]
    print("[team] " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return run


def store_stats(run: Path, name: str) -> dict:
    """Response tokens sampled per agent, episodes, solver calls, and calculator calls per step."""
    import h5py
    from flexmarl_hpc.store.schema import TOOL_OUTCOMES
    with h5py.File(run / f"{name}.h5", "r", swmr=True) as f:
        agents = [a.decode() if isinstance(a, bytes) else a for a in f.attrs["agents"]]
        tokens = {a: int(f[f"samples/{a}"]["response_len"].sum()) for a in agents}
        ep = f["episodes"][:]
        tl = f["tools"][:]
    episodes = [(int(r["step"]), int(r["input_id"]), int(r["traj"])) for r in ep]
    calls = [(int(r["input_id"]), int(r["traj"]), TOOL_OUTCOMES[int(r["outcome"])]) for r in tl
             if r["tool"] == b"calculator"]
    solver = agents.index("solver")
    return {"tokens": tokens, "episodes": len(episodes), "solver_calls": int(sum(r["calls"][solver] for r in ep)),
            "curve": calls_per_step(episodes, calls)}


def evaluate(out: Path, run: Path | None, tag: str, only: str, n: int, launch: bool = True) -> list[dict] | None:
    """Per-problem scores of one version (kept in out/eval_<tag>; None when not there and not launched)."""
    rows = out / f"eval_{tag}"
    kept = sorted(rows.glob("base.json" if only == "base" else "v*.json"), key=lambda q: (len(q.name), q.name))
    if kept and json.loads(kept[-1].read_text())["n"] == n:
        return json.loads(kept[-1].read_text())["rows"]
    if not launch or run is None:
        return None
    cmd = [sys.executable, "scripts/eval_heldout.py", str(run), "-n", str(n), "--only", only, "--rows", str(rows)]
    print("[team] " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    kept = sorted(rows.glob("base.json" if only == "base" else "v*.json"), key=lambda q: (len(q.name), q.name))
    return json.loads(kept[-1].read_text())["rows"]


def plot(curves: dict[str, dict[int, dict]], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for label, curve in curves.items():
        steps = sorted(curve)
        ax.plot(steps, [curve[s]["ok"] for s in steps], marker="o", label=f"{label}: calls run")
        ax.plot(steps, [curve[s]["refused"] for s in steps], marker="x", ls="--", label=f"{label}: calls refused")
    ax.set_xlabel("training step (episodes sampled at rollout.temperature)")
    ax.set_ylabel("calculator calls per episode")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "runs/team_experiment")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps of each training run")
    ap.add_argument("--inputs", type=int, default=6, help="the team's problems a step (x group_size 4 episodes)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("-n", type=int, default=200, help="held-out problems, paired")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", type=Path, default=ROOT / "docs/team_experiment.png")
    ap.add_argument("--report-only", action="store_true", help="train and evaluate nothing: report what "
                    "the runs and evaluations done so far hold")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.inputs < 1 or a.n < 1:
        ap.error("--steps, --inputs and -n: expected positive counts")
    out = a.out.resolve()
    train_rows, heldout = write_data(out / "data", a.seed, 2000, max(a.n, 300))
    shared = check_disjoint(train_rows, heldout)
    print(f"[team] held-out {len(heldout)} vs train {len(train_rows)}: " + ", ".join(f"{k} {v}" for k, v in shared.items())
          + f"; templates {sorted({r['template'] for r in heldout})} vs {sorted({r['template'] for r in train_rows})}")
    if any(shared.values()):
        print("[team] the held-out set overlaps training; stopped")
        return 1

    go = not a.report_only
    try:
        team = train(out, "team", overrides(out, "team", a.steps, a.inputs, a.max_new_tokens), a.steps, go)
        ts = store_stats(out / "team", "team") if (out / "team/team.h5").exists() else None
        single = ss = None
        if team is not None:
            per_episode = sum(ts["tokens"].values()) / ts["episodes"]
            # a solver thread: 2 calls with the forced calculator (the call, then the answer)
            per_thread = ts["tokens"]["solver"] / (ts["solver_calls"] / 2)
            inputs_single = max(1, round(a.inputs * per_episode / per_thread))
            print(f"[team] team: {per_episode:.1f} response tokens per episode, {per_thread:.1f} per solver thread "
                  f"-> the single solver gets {inputs_single} problems a step")
            single = train(out, "single", overrides(out, "single", a.steps, inputs_single, a.max_new_tokens) + SINGLE,
                           a.steps, go)
        if single is not None:
            ss = store_stats(single, "single")
            t_team, t_single = sum(ts["tokens"].values()), sum(ss["tokens"].values())
            print(f"[team] compute: response tokens sampled, team {t_team} ({ts['episodes']} episodes), single "
                  f"{t_single} ({ss['episodes']} episodes): single/team - 1 = {t_single / t_team - 1:+.3f}")
        rows = {"base team": evaluate(out, out / "team", "team", "base", a.n, go),
                "trained team": evaluate(out, team, "team", "latest", a.n, go),
                "trained single": evaluate(out, single, "single", "latest", a.n, go)}
    except subprocess.CalledProcessError as e:
        print(f"[team] {' '.join(map(str, e.cmd[1:4]))}...: exit status {e.returncode}; rerun the same command to go on")
        return 1
    report(rows, {"team": ts, "single": ss}, a.plot)
    return 0


def report(rows: dict[str, list[dict] | None], stores: dict[str, dict | None], png: Path) -> None:
    for k, r in rows.items():
        if r is None:
            print(f"[team] {k:15s} not evaluated")
            continue
        m = {key: sum(x.get(key, 0.0) for x in r) / len(r) for key in ("team_correct", "tool_calls", "tool_errors", "solvers")}
        print(f"[team] {k:15s} n={len(r)} team_correct {m['team_correct']:.3f}  calculator calls per episode: "
              f"parsed {m['tool_calls']:.2f}, unreadable {m['tool_errors']:.2f}  solvers {m['solvers']:.2f}")
    score = {k: [x["team_correct"] for x in r] for k, r in rows.items() if r is not None}
    for x, y in (("trained team", "base team"), ("trained team", "trained single"), ("trained single", "base team")):
        if x in score and y in score:
            w, l, t = flips(score[x], score[y])
            print(f"[team] {x} vs {y}: wins {w}, losses {l}, ties {t}, sign test p = {sign_test(w, l):.3g}")
    curves = {label: s["curve"] for label, s in stores.items() if s is not None}
    for label, curve in curves.items():
        print(f"[team] {label} training, calculator calls per episode by step (run / refused): "
              + ", ".join(f"{k}: {v['ok']:.2f}/{v['refused']:.2f}" for k, v in curve.items()))
    if curves:
        plot(curves, png)
        print(f"[team] plot: {png}")

if __name__ == "__main__":
    raise SystemExit(main())
