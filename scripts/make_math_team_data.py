"""Write the math_team word-problem dataset (generated from a seed, nothing downloaded).

    PYTHONPATH=$PWD .venv/bin/python scripts/make_math_team_data.py            # data/math_team/{train,eval}.jsonl
    PYTHONPATH=$PWD .venv/bin/python scripts/make_math_team_data.py --seed 1 --train 500 --eval 200 --out /tmp/mt

One JSON object per line: {"question": str, "answer": int, "steps": 1..4}. The problems come
from flexmarl_hpc/workflows/wordproblems.py (shopping, sharing, rates, ages; 1 to 4 operations,
40/30/20/10 %); no eval question is a train question. The same arguments write the same bytes.
Each file is replaced whole (tmp, fsync, rename): a killed run leaves the old file or the new one.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from flexmarl_hpc.store.checkpoint import replace_file
from flexmarl_hpc.workflows.wordproblems import Problem, train_and_eval


def jsonl(problems: list[Problem]) -> bytes:
    return "".join(json.dumps(p.row()) + "\n" for p in problems).encode()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train", type=int, default=2000, help="training problems")
    ap.add_argument("--eval", type=int, default=300, help="held-out problems")
    ap.add_argument("--max-steps", type=int, default=2, choices=[1, 2, 3, 4],
                    help="problems of at most this many operations")
    ap.add_argument("--out", type=Path, default=Path("data/math_team"))
    args = ap.parse_args(argv)
    if args.train <= 0 or args.eval <= 0:
        ap.error("--train and --eval: expected positive counts")
    train, heldout = train_and_eval(args.seed, args.train, args.eval, args.max_steps)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, problems in (("train", train), ("eval", heldout)):
        replace_file(args.out / f"{name}.jsonl", jsonl(problems))
        mix = Counter(p.steps for p in problems)
        print(f"{args.out / name}.jsonl: {len(problems)} problems, steps "
              + " ".join(f"{k}:{mix[k]}" for k in sorted(mix)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
