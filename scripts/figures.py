"""Regenerate every generated figure in docs/*.md from the code at HEAD.

    python scripts/figures.py --check      # recompute the deterministic figures; exit 1 naming each drifted block
    python scripts/figures.py --write      # rewrite the deterministic blocks (and their PNGs) in place
    python scripts/figures.py --full       # also run the benchmarks and rewrite their blocks
    python scripts/figures.py --list       # the figure names, their kind and where they are used
    python scripts/figures.py --full --only bench_store   # just these blocks (names, or a,b)

A generated block in any docs/*.md is

    <!-- figure: NAME -->
    ...markdown made by FIGURES[NAME]: a table, a code block of command output, an image link...
    <!-- /figure: NAME -->

and everything between the two markers belongs to this script. Two kinds of figure:
deterministic ones (the simulator: the same code gives the same text on any machine, so CI
runs --check) and bench ones (measured on this machine: each block says when, on how many
cores of which CPU, and gives median [min, max]; only --full runs them).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import difflib
import io
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flexmarl_hpc.sim.capacity_cli import capacity  # noqa: E402
from flexmarl_hpc.sim.compare_cli import compare_table  # noqa: E402
from flexmarl_hpc.sim.plan_cli import plan, plan_report  # noqa: E402
from flexmarl_hpc.sim.runs import run_variants, write_atomic  # noqa: E402
from flexmarl_hpc.sim.scale_cli import scale, scale_table  # noqa: E402
from flexmarl_hpc.sim import plan as sim_plan  # noqa: E402
from flexmarl_hpc.sim.hardware import load_hardware  # noqa: E402
from flexmarl_hpc.sim.scale import bottleneck_table, parse_sizes, plot_scale  # noqa: E402

BLOCK = re.compile(r"<!-- figure: (?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- /figure: (?P=name) -->", re.S)
PAPER_MIX = "configs/paper_3x32b_7x14b.yaml"
SCALE_COUNTS = "1,16,64,128,256,512,768,1024,3072"     # few: --check makes them all
SCALE_VARIANTS = ["sync", "flex"]
SCALE_PNG = "scale_paper_3x32b_7x14b.png"
SCALE_OVERRIDES: list[str] = []
"""None since 2026-11-29: the config's episode is `simulate paper`'s workload (settle true)."""
SEEDS = 5
"""Workload seeds of the stochastic simulator figures (paper, compare): mean [min, max]."""
PAPER_CLASSES = "32b:3,14b:7"
CLOSED_FORM_NODES = (6, 8, 12, 16, 24, 32, 48, 96, 192)


@dataclasses.dataclass(frozen=True)
class Context:
    """Where the figures go: `docs` (the folder of the markdown files, where PNGs are drawn
    when `draw`) and a scratch folder for simulated runs."""
    docs: Path
    scratch: Path
    draw: bool = False


@dataclasses.dataclass(frozen=True)
class Figure:
    make: Callable[[Context], str]
    bench: bool = False                # measured on this machine: only --full makes it


def command_block(command: str, output: str, note: str = "") -> str:
    """A code block of a command and what it printed (and a line under it, if any)."""
    return f"```\n$ {command}\n{output.rstrip()}\n```" + (f"\n{note}" if note else "")


def sim_compare_paper_mix(ctx: Context) -> str:
    """sync vs flex on the paper's 3 x 32B + 7 x 14B mix, 48 nodes of 64 GB accelerators, over
    workload seeds 0-4 (mean [min, max])."""
    from flexmarl_hpc.sim.compare_cli import seed_overrides, seeds_table
    runs = [run_variants(PAPER_MIX, ["sync", "flex"], "npu64_a3", 8, ctx.scratch / f"compare{k}",
                         seed_overrides(PAPER_MIX, k)) for k in range(SEEDS)]
    args = [PAPER_MIX, "--hardware", "npu64_a3", "--steps", "8", "--variants", "sync,flex", "--workload-seeds", str(SEEDS)]
    return command_block(f"python -m flexmarl_hpc.simulate compare {' '.join(args)}",
                         seeds_table(PAPER_MIX, "npu64_a3", 8, runs))


def sim_plan_48(ctx: Context) -> str:
    """The closed-form planner's best 3 splits of 48 nodes for the paper's mix, simulated."""
    hw = load_hardware("npu64_a3")
    rows, current = plan(PAPER_MIX, 48, "npu64_a3", 3, 4, ctx.scratch / "plan")
    return command_block(f"python -m flexmarl_hpc.simulate plan {PAPER_MIX} --nodes 48 --top 3 --steps 4",
                         plan_report(PAPER_MIX, [], 48, 4, hw, rows, current, wall=False),
                         "(the wall_s column, seconds this machine took, is left out)")


def sim_scale(ctx: Context) -> str:
    """Step time and utilization of every variant against the accelerator count, each count
    on the planner's split for it; the table, and the curve drawn from it."""
    variants = SCALE_VARIANTS
    rows = scale(PAPER_MIX, parse_sizes(SCALE_COUNTS), variants, "npu64_a3", 4,
                 ctx.scratch / "scale", SCALE_OVERRIDES)
    if ctx.draw:
        plot_scale(rows, variants, ctx.docs / SCALE_PNG, f"{Path(PAPER_MIX).name} on npu64_a3: simulated, seed 0, "
                                                        f"4 steps, closed-form planner's allocation per size")
    command = (f"python -m flexmarl_hpc.simulate scale {' '.join([PAPER_MIX, *SCALE_OVERRIDES])} --counts "
               f"{SCALE_COUNTS} --variants {','.join(variants)} --steps 4 --png docs/{SCALE_PNG}")
    return f"![simulated step time and utilization against accelerators]({SCALE_PNG})\n\n" + command_block(
        command, scale_table(rows, variants) + "\n" + bottleneck_table(rows, variants))


def _paper_hw():
    from flexmarl_hpc.sim.paper_cli import PARAMS
    return load_hardware(PARAMS)


def sim_paper(ctx: Context) -> str:
    """Tables 2-3 against the simulator on the fitted parameters file, MA fitted, CA predicted,
    every figure over workload seeds 0-4, 8 steps, two runs at a time (`simulate paper`'s
    defaults)."""
    from flexmarl_hpc.sim.paper import paper_rows, table
    rows = paper_rows(_paper_hw(), 8, ctx.scratch / "paper", seeds=SEEDS, jobs=2)
    return command_block("python -m flexmarl_hpc.simulate paper", table(rows, "MA"))


def sim_plan_closed_form_48(ctx: Context) -> str:
    """The closed-form planner alone (no simulation): its best 3 splits of 48 nodes on each
    profile, for the paper's classes."""
    outs = []
    for hw in ("npu64_a3", "h100_ndr"):
        command = f"python -m flexmarl_hpc.sim.plan --hardware {hw} --nodes 48 --classes {PAPER_CLASSES}"
        with contextlib.redirect_stdout(io.StringIO()) as out:
            sim_plan.main(command.split()[3:])
        outs.append(command_block(command, out.getvalue()))
    return "\n\n".join(outs)


def sim_plan_closed_form_scaling(ctx: Context) -> str:
    """Closed-form step time of each mode on its own best split, against the node count."""
    hw, classes = load_hardware("npu64_a3"), sim_plan.parse_classes(PAPER_CLASSES)
    best = {(mode, n): sim_plan.rank_plans(hw, classes, sim_plan.Workload(), n, mode, 1)[0]
            for mode in ("flex", "sync") for n in CLOSED_FORM_NODES}
    cells = {"flex": [best["flex", n].step_s["flex"] for n in CLOSED_FORM_NODES],
             "sync": [best["sync", n].step_s["sync"] for n in CLOSED_FORM_NODES]}
    head = " | ".join(f"{n} ({n * hw.devices_per_node})" for n in CLOSED_FORM_NODES)
    rows = [f"| nodes (devices) | {head} |", "|---" * (len(CLOSED_FORM_NODES) + 1) + "|"]
    rows += [f"| {mode} step, s | " + " | ".join(f"{x:.1f}" for x in xs) + " |" for mode, xs in cells.items()]
    rows.append("| sync / flex | " + " | ".join(f"{s / f:.2f}" for s, f in zip(cells["sync"], cells["flex"])) + " |")
    return (f"`sim.plan.rank_plans` on `npu64_a3`, classes {PAPER_CLASSES}, each mode on its own best split:\n\n"
            + "\n".join(rows))


def sim_memory_paper_mix(ctx: Context) -> str:
    """simulate memory on the paper's mix at Qwen2.5-14B/32B's real shapes and vocabulary:
    checkpoint folders of safetensors headers only (scripts/qwen_headers.py), the config's
    models replaced by them; the temporary folder is printed as $QWEN."""
    import importlib.util
    import tempfile
    from flexmarl_hpc.sim.memory import memory_report
    spec = importlib.util.spec_from_file_location("qwen_headers", ROOT / "scripts" / "qwen_headers.py")
    qh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qh)
    with tempfile.TemporaryDirectory() as tmp:
        config = qh.make(Path(tmp))
        text, code = memory_report(str(config), [], "npu64_a3", False)
    return command_block("python scripts/qwen_headers.py $QWEN && python -m flexmarl_hpc.simulate memory "
                         "$QWEN/paper_3x32b_7x14b_qwen.yaml", text.replace(tmp, "$QWEN"), f"(exit code {code})")


def machine() -> str:
    """When and where a benchmark ran: the date, the cores, the CPU model and the load average
    as it started (other work on the cores widens the spread)."""
    model = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores, {model}, Python "
            f"{platform.python_version()}, load average {os.getloadavg()[0]:.1f}")


def spread(xs: list[float], fmt: str = ".0f") -> str:
    return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}, {max(xs):{fmt}}]"


def sim_capacity(ctx: Context, reps: int = 5) -> str:
    """The orchestrator's own samples/s (zero-cost workers, its real compute on the clock):
    a property of this CPU, so a bench figure."""
    runs = [capacity("configs/local.yaml", 10, ctx.scratch / f"capacity{i}") for i in range(reps)]
    out = (f"orchestrator capacity, configs/local.yaml, flex, 10 steps, {reps} runs: median [min, max]\n"
           f"  samples/s   {spread([r['samples_per_s'] for r in runs])}\n"
           f"  commands/s  {spread([r['commands_per_s'] for r in runs])}")
    return command_block("python -m flexmarl_hpc.simulate capacity configs/local.yaml", out, f"measured {machine()}")


def bench(script: str, *args: str, python: str | None = None, timeout: int = 3600) -> Callable[[Context], str]:
    """A bench figure: `bench/<script> args` run here (by `python`, a venv's relative path,
    or this interpreter), its output (which gives median [min, max] per figure) under the
    date and the machine."""
    def make(ctx: Context) -> str:
        command = [python or sys.executable, f"bench/{script}", *args]
        p = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"bench/{script} exited {p.returncode}: {p.stderr.strip()[-2000:]}")
        return command_block(" ".join([python or "python", *command[1:]]), p.stdout, f"measured {machine()}")
    return make


FIGURES: dict[str, Figure] = {
    "sim_compare_paper_mix": Figure(sim_compare_paper_mix),
    "sim_plan_48": Figure(sim_plan_48),
    "sim_scale": Figure(sim_scale),
    "sim_plan_closed_form_48": Figure(sim_plan_closed_form_48),
    "sim_plan_closed_form_scaling": Figure(sim_plan_closed_form_scaling),
    "sim_memory_paper_mix": Figure(sim_memory_paper_mix),
    "sim_capacity": Figure(sim_capacity, bench=True),
    # deterministic but slow (minutes): only --full makes them, so that --check stays short
    # (sim_paper: 5 seeds x 5 systems x 2 tasks, ~6 min of CPU; tests/sim/test_sim_paper.py
    # checks its machinery on every run)
    "sim_paper": Figure(sim_paper, bench=True),
    "bench_store": Figure(bench("bench_store.py"), bench=True),
    "bench_weight_sync": Figure(bench("bench_weight_sync.py"), bench=True),
    "bench_relay": Figure(bench("bench_relay.py"), bench=True),
    "bench_rollout": Figure(bench("bench_rollout.py", python=".venv-vllm/bin/python"), bench=True),
    "bench_ckpt_memory": Figure(bench("bench_ckpt_memory.py"), bench=True),
    "bench_cores": Figure(bench("bench_cores.py", "--pollers", "2"), bench=True),
    "bench_state_move": Figure(bench("bench_state_move.py"), bench=True),
    "bench_modes": Figure(bench("bench_modes.py", "--workloads", "referential", "--variants", "sync", "flex",
                                "--reps", "3"), bench=True),
}
"""Block name -> its generator. Names are stable: the docs refer to them."""


def blocks(text: str) -> list[tuple[str, str]]:
    """(name, body) of each generated block of a markdown text, in order."""
    return [(m["name"], m["body"]) for m in BLOCK.finditer(text)]


def replace_blocks(text: str, made: dict[str, str]) -> str:
    """`text` with the body of each block named in `made` replaced by it."""
    def sub(m: re.Match) -> str:
        name = m["name"]
        return m[0] if name not in made else f"<!-- figure: {name} -->\n{made[name].rstrip()}\n<!-- /figure: {name} -->"
    return BLOCK.sub(sub, text)


def wanted(docs: Path, full: bool) -> tuple[dict[Path, list[tuple[str, str]]], list[str]]:
    """Per markdown file its blocks, and the errors: an unknown name, or a block the mode
    does not make (bench blocks are only made by --full)."""
    found = blocks_of(docs)
    errors = [f"{p}: unknown figure {name!r} (known: {', '.join(FIGURES)})"
              for p, bs in found.items() for name, _ in bs if name not in FIGURES]
    return {p: [(n, b) for n, b in bs if n in FIGURES and (full or not FIGURES[n].bench)]
            for p, bs in found.items()}, errors


def make_all(names: list[str], ctx: Context) -> dict[str, str]:
    made = {}
    for name in dict.fromkeys(names):
        print(f"figures: making {name}", file=sys.stderr, flush=True)
        made[name] = FIGURES[name].make(ctx).rstrip() + "\n"
    return made


def check(found: dict[Path, list[tuple[str, str]]], made: dict[str, str]) -> list[str]:
    """The blocks whose text differs from what the code makes now, each with its diff."""
    drifted = []
    for path, bs in found.items():
        for name, body in bs:
            if body != made[name]:
                diff = difflib.unified_diff(body.splitlines(), made[name].splitlines(), f"{path}: {name} (in the doc)",
                                            f"{name} (made now)", lineterm="")
                drifted.append(f"{path}: figure {name} drifted\n" + "\n".join(diff))
    return drifted


def blocks_of(docs: Path) -> dict[Path, list[tuple[str, str]]]:
    """Per markdown file of `docs`, its blocks."""
    return {p: blocks(p.read_text()) for p in sorted(docs.glob("*.md"))}


@contextlib.contextmanager
def at_root():
    """The repository as the working folder (the config paths as the figures print them),
    then back to where it was."""
    cwd = Path.cwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(cwd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/figures.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    for flag in ("--check", "--write", "--full", "--list"):
        mode.add_argument(flag, action="store_true")
    ap.add_argument("--docs", type=Path, default=ROOT / "docs", help="the folder of the markdown files")
    ap.add_argument("--only", nargs="+", metavar="NAME", default=None,
                    help="only these figures (names, or comma-separated; e.g. --full --only bench_store)")
    args = ap.parse_args(argv)
    args.docs = args.docs.resolve()
    with at_root():
        return run(args)


def run(args: argparse.Namespace) -> int:
    """--list, --check, --write or --full on the blocks of `args.docs`."""
    found, errors = wanted(args.docs, args.full)
    only = {n for a in (args.only or []) for n in a.split(",") if n}
    if only - set(FIGURES):
        errors.append(f"--only: unknown figure(s) {sorted(only - set(FIGURES))} (--list shows them)")
    if only:
        found = {p: kept for p, bs in found.items() if (kept := [(n, b) for n, b in bs if n in only])}
    if args.list:
        used = {n: [p.name for p, bs in blocks_of(args.docs).items() if n in dict(bs)] for n in FIGURES}
        print(json.dumps({n: {"bench": f.bench, "in": used[n]} for n, f in FIGURES.items()}, indent=1))
        return 0
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        made = make_all([n for bs in found.values() for n, _ in bs], Context(args.docs, Path(tmp), draw=not args.check))
    if args.check:
        drifted = check(found, made)
        print("\n\n".join(drifted) if drifted else f"figures: {len(made)} deterministic figure(s) as in the docs")
        return 1 if drifted else 0
    for path in found:
        text = path.read_text()
        new = replace_blocks(text, made)
        if new != text:
            write_atomic(path, new)
            print(f"figures: rewrote {path}", file=sys.stderr)
    return 0

if __name__ == "__main__":
    sys.exit(main())
