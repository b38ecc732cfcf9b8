"""A cross-group state move of a megatron TP2 x PP2 agent (two groups of 4 ranks, 8 ranks):
shard to shard (each rank sends its own storages to its counterpart) against the state()
fallback (the full HF state gathered on every rank of the source group and sent whole to
every rank of the destination), in the same run, so the two paths interleave rep by rep;
and resharded into a TP1 x PP(2 x PP) group (runtime/reshard.py's pieces), a run of its own
interleaved with those.

    .venv/bin/python bench/bench_state_move.py [--reps 3] [--tp 2 --pp 2]

Runs tests/mpi/mpi_megatron_move.py TP PP big and tests/mpi/mpi_megatron_reshard.py TPxPP
1x(TP*PP) big (both also check bit-equality) `--reps` times each and prints, per path and group, the bytes each rank received and its peak RSS above its RSS
before the move (VmHWM reset through /proc/self/clear_refs; glibc's mmap threshold at 64 KiB
so freed buffers leave the RSS and new ones enter it), the max over the group's ranks, as
median [min, max] over the reps, and the ratio fallback / shard of each. CPU: "device" and
host memory are the same RAM, so a resident source's offload counts too.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^   (.+?): group (\d) received max ([\d.]+) MiB/rank, peak RSS above before max "
                  r"(-?[\d.]+) MiB/rank")


def run(tp: int, pp: int, reshard: bool = False) -> dict[tuple[str, int], tuple[float, float]]:
    n = 2 * tp * pp
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "MALLOC_MMAP_THRESHOLD_": "65536"}
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    script = ["tests/mpi/mpi_megatron_reshard.py", f"{tp}x{pp}", f"1x{tp * pp}"] if reshard else \
        ["tests/mpi/mpi_megatron_move.py", str(tp), str(pp)]
    p = subprocess.run([mpiexec, "-n", str(n), sys.executable, "-m", "mpi4py", *script, "big"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    if f"all megatron {'reshard' if reshard else 'move'} checks passed" not in p.stdout:
        raise SystemExit(f"the move run failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return {(m[1], int(m[2])): (float(m[3]), float(m[4]))
            for m in map(LINE.match, p.stdout.splitlines()) if m}


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}, {max(xs):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    a = ap.parse_args()
    reps = []
    for _ in range(a.reps):                       # interleaved: a move run, then a reshard run
        reps.append(run(a.tp, a.pp))
        reps[-1].update(run(a.tp, a.pp, reshard=True))
    shard, old = "shard R0 -> R1", "state() fallback R1 -> R0"
    resh = f"resharded TP{a.tp} x PP{a.pp} -> TP1 x PP{a.tp * a.pp}"
    print(f"TP{a.tp} x PP{a.pp}, two groups of {a.tp * a.pp} ranks, {a.reps} reps: max over a group's ranks, "
          f"MiB, median [min, max]")
    for what in (shard, old, "shard P0 -> P1", resh):
        src = 0 if what == resh else int(re.search(r"[RP](\d) ->", what)[1])
        for g in (0, 1):
            got = [r[(what, g)] for r in reps]
            print(f"  {what:26s} group {g} ({'source' if g == src else 'destination'}): "
                  f"received {fmt([x[0] for x in got])}, peak RSS {fmt([x[1] for x in got])}")
    # the shard move goes 0 -> 1, the fallback 1 -> 0
    for label, g_shard, g_old in (("source", 0, 1), ("destination", 1, 0)):
        ratio = [r[(old, g_old)][1] / r[(shard, g_shard)][1] for r in reps]
        print(f"  peak RSS ratio fallback / shard, {label}: {fmt(ratio)}")
        ratio = [r[(old, g_old)][1] / r[(resh, g_shard)][1] for r in reps]
        print(f"  peak RSS ratio fallback / resharded, {label}: {fmt(ratio)}")

if __name__ == "__main__":
    main()
