"""How often does a base model solve the math_team problems on its own? Greedy, one call per
problem, scored by workflows/mathcheck.answer_correct; prints accuracy per number of steps.

    PYTHONPATH=$PWD .venv/bin/python scripts/make_math_team_data.py
    PYTHONPATH=$PWD .venv/bin/python scripts/probe_math_team.py -n 96 --max-new-tokens 128 --system ""
    PYTHONPATH=$PWD .venv/bin/python scripts/probe_math_team.py -n 48 --steps 1 --max-new-tokens 96 --system ""

A check that the data is learnable from (a model that never answers right gets no GRPO
signal), not the team's evaluation. The prompt is the chat template of the checkpoint
folder (its `chat_template.jinja`, or tokenizer_config.json's `chat_template`) rendered with
jinja2; generation is flexmarl_hpc.learn (KV cache, left padding, greedy), on CPU.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import jinja2
import torch
from tokenizers import Tokenizer

from flexmarl_hpc.learn.model import load_hf_checkpoint
from flexmarl_hpc.learn.sampling import SamplingParams, generate
from flexmarl_hpc.workflows.mathcheck import answer_correct

GREEDY = SamplingParams(temperature=0.0)
SYSTEM = "Solve the math word problem. Think step by step, then end with 'Answer: N'."


def chat_template(folder: Path) -> jinja2.Template:
    path = folder / "chat_template.jinja"
    text = path.read_text() if path.exists() else json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    return jinja2.Environment().from_string(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path("models/smollm2-135m-instruct"))
    ap.add_argument("--data", type=Path, default=Path("data/math_team/eval.jsonl"))
    ap.add_argument("-n", type=int, default=120, help="the first n problems of --data (of --steps)")
    ap.add_argument("--steps", type=int, nargs="*", default=[1, 2, 3, 4], help="only problems of these step counts")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--system", default=SYSTEM, help="the system message (\"\": none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    problems = [p for p in map(json.loads, args.data.read_text().splitlines()) if p["steps"] in args.steps][:args.n]
    tok, template = Tokenizer.from_file(str(args.model / "tokenizer.json")), chat_template(args.model)
    model = load_hf_checkpoint(args.model).eval()
    end = tok.token_to_id("<|im_end|>")
    right, total, t0 = defaultdict(int), defaultdict(int), time.time()
    for i in range(0, len(problems), args.batch):
        chunk = problems[i:i + args.batch]
        system = [{"role": "system", "content": args.system}] if args.system else []
        prompts = [tok.encode(template.render(messages=system + [{"role": "user", "content": p["question"]}],
                                              add_generation_prompt=True), add_special_tokens=False).ids
                   for p in chunk]
        with torch.no_grad():
            gens = generate(model, prompts, [0] * len(chunk), [args.max_new_tokens] * len(chunk), GREEDY,
                            end, frozenset({end}))
        for p, g in zip(chunk, gens):
            ok = answer_correct(tok.decode(g.tokens), p["answer"])
            right[p["steps"]] += ok
            total[p["steps"]] += 1
    print(f"{args.model.name}, {len(problems)} problems of {args.data}, greedy, {args.max_new_tokens} new tokens, "
          f"{time.time() - t0:.0f} s")
    for k in sorted(total):
        print(f"  {k} step(s): {right[k]}/{total[k]} = {right[k] / total[k]:.2f}")
    print(f"  all      : {sum(right.values())}/{len(problems)} = {sum(right.values()) / len(problems):.2f}")


if __name__ == "__main__":
    main()
