"""The sandbox's cost per call: a tool call through the sandbox vs a bare subprocess of the
same interpreter running the same one-line program.

    .venv/bin/python bench/bench_sandbox.py [--reps 7]

Both run `print(6 * 7)` with `python -I -S`: the bare one as a plain child
(asyncio.create_subprocess_exec), the sandboxed one through flexmarl_hpc.tools.sandbox
(a fresh directory, the launcher, namespaces, private /tmp and /proc, rlimits, the nobody
uid, cleanup). Interleaved A/B `--reps` times after one untimed pair; prints wall
milliseconds per call, median [min, max], the ratio of medians, and the isolation in force.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexmarl_hpc.config.tools import ToolsConfig
from flexmarl_hpc.tools.sandbox import run_code

CODE = "print(6 * 7)"


async def bare(python: str) -> float:
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(python, "-I", "-S", "-c", CODE, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert out == b"42\n", out
    return time.perf_counter() - t0


async def sandboxed(cfg: ToolsConfig) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = await run_code(CODE, cfg)
    assert (r.outcome, r.stdout) == ("ok", "42\n"), r
    return time.perf_counter() - t0, r.isolation


def fmt(xs: list[float]) -> str:
    ms = [1000 * x for x in xs]
    return f"{statistics.median(ms):7.1f} ms [{min(ms):.1f}, {max(ms):.1f}]"


async def main(reps: int) -> None:
    cfg = ToolsConfig()
    python = cfg.interpreter()
    await bare(python), await sandboxed(cfg)                  # untimed: page cache, imports
    a, b, iso = [], [], {}
    for _ in range(reps):
        a.append(await bare(python))
        t, iso = await sandboxed(cfg)
        b.append(t)
    print(f"sandbox launch, `{CODE}` with {python} -I -S, {reps} interleaved reps after 1 untimed")
    print(f"  bare subprocess : {fmt(a)}")
    print(f"  sandbox         : {fmt(b)}")
    print(f"  ratio of medians: {statistics.median(b) / statistics.median(a):.2f}x")
    print(f"  isolation       : {iso}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7, help="interleaved A/B repetitions (>= 3)")
    asyncio.run(main(max(3, ap.parse_args().reps)))
