"""The scaling sweep's pure part: accelerator counts -> node counts -> the planner's allocation.

`simulate scale CONFIG --counts 1,2,...,3072` asks, per accelerator count, the same closed-form
planner as `simulate plan` (sim/plan.py `rank_plans`, per mode: sync's best split for the sync
variant, flex's for the flex variants) for the best split of that many devices among the
config's pools and trainer groups, then simulates it (sim/scale_cli.py). This module decides the
sizes and allocations; it runs nothing and writes only the PNG (`plot_scale`).

Counts map to nodes of the hardware profile: `ceil(devices / devices_per_node)` nodes (the
orchestrator's CPU node comes on top and holds no accelerator). Below one node the count is a
single node holding only that many devices: a copy of the profile with `devices_per_node =
devices` and the NICs scaled with it (`node_slice`). The planner gives every pool and every
trainer group whole nodes, so a size below (pool node + smallest group) per class does not
fit; it is reported with the reason, not simulated.
"""
from __future__ import annotations

import dataclasses
import math
import io
from dataclasses import dataclass, field
from pathlib import Path

from flexmarl_hpc.config.schema import Config
from flexmarl_hpc.sim.hardware import HardwareProfile
from flexmarl_hpc.sim.plan import Allocation, Workload, rank_plans
from flexmarl_hpc.sim.plan_config import ConfigClass, min_nodes
from flexmarl_hpc.store.checkpoint import replace_file

MODES = ("sync", "flex")


@dataclass(frozen=True)
class ScalePoint:
    """One accelerator count of the sweep and the planner's answer for it."""

    devices: int
    """Accelerators asked for."""
    nodes: int
    """Nodes they occupy (pools and trainer groups; the orchestrator's node not counted)."""
    hw: HardwareProfile
    """The profile the allocation is planned and simulated on (a `node_slice` below one node)."""
    plans: dict[str, Allocation] = field(default_factory=dict)
    """Best closed-form plan per mode ("sync", "flex"); empty when the size does not fit."""
    reason: str = ""
    """Why the size does not fit (empty when it does)."""

    @property
    def devices_used(self) -> int:
        """Accelerators of the whole nodes (>= devices when it is not a multiple of a node)."""
        return self.nodes * self.hw.devices_per_node

    @property
    def fits(self) -> bool:
        return not self.reason


def parse_sizes(text: str, flag: str = "--scale") -> list[int]:
    """`1,2,4` -> [1, 2, 4]: positive integers, no repeats, sorted ascending.
    ValueError with a one-line message naming `flag` otherwise."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p.isdigit() or int(p) < 1 for p in parts):
        raise ValueError(f"{flag}: expected comma-separated accelerator counts >= 1 (e.g. 1,2,4,3072), "
                         f"got {text!r}")
    sizes = [int(p) for p in parts]
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"{flag}: a count is repeated in {text!r}")
    return sorted(sizes)


def node_slice(hw: HardwareProfile, devices: int) -> HardwareProfile:
    """A node of `hw` of which only `devices` accelerators are allocated: the same devices,
    with the node's NICs in proportion (a device keeps its share of the inter-node bandwidth)."""
    if not 1 <= devices <= hw.devices_per_node:
        raise ValueError(f"devices: expected 1..{hw.devices_per_node}, got {devices}")
    if devices == hw.devices_per_node:
        return hw
    nics = max(1, round(hw.nics_per_node * devices / hw.devices_per_node))
    return dataclasses.replace(hw, name=f"{hw.name}[{devices} of {hw.devices_per_node} devices]",
                               devices_per_node=devices, nics_per_node=nics)


def scale_points(sizes: list[int], hw: HardwareProfile, classes: list[ConfigClass], work: Workload,
                 cfg: Config, modes: tuple[str, ...] = MODES) -> list[ScalePoint]:
    """Per accelerator count: its nodes, profile, and the planner's best plan per mode, or
    the reason it does not fit."""
    out = []
    for n in sizes:
        node_hw = node_slice(hw, n) if n < hw.devices_per_node else hw
        nodes = math.ceil(n / node_hw.devices_per_node)
        try:
            need = min_nodes(node_hw, classes, cfg) - cfg.slurm.orchestrator.nodes
        except ValueError as e:                      # a model fits no node of this size
            out.append(ScalePoint(n, nodes, node_hw, reason=f"does not fit: {e}"))
            continue
        why = "per agent class a pool node and its smallest trainer group, each of whole nodes"
        if n < hw.devices_per_node:
            out.append(ScalePoint(n, nodes, node_hw, reason=(
                f"does not fit: {n} of a node's {hw.devices_per_node} devices make one node, and the "
                f"planner needs >= {need} nodes of {n} devices ({why})")))
            continue
        if nodes < need:
            out.append(ScalePoint(n, nodes, node_hw, reason=(
                f"does not fit: needs >= {need} nodes = {need * hw.devices_per_node} accelerators "
                f"({why}), got {nodes}")))
            continue
        plans = {m: rank_plans(node_hw, [c.cls for c in classes], work, nodes, m, top=1)[0] for m in modes}
        out.append(ScalePoint(n, nodes, node_hw, plans))
    return out


def plot_scale(rows: list[dict], variants: list[str], path: Path, title: str) -> None:
    """Two panels against accelerators (log x): step time (log y) and utilization, one line per
    variant; sizes that do not fit or failed are left out. `rows`: the rows of `simulate scale`
    (`devices_used`, `variants` -> {step_s, util}). Written atomically (tmp + rename)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    fig, (ax_t, ax_u) = plt.subplots(1, 2, figsize=(10, 4), dpi=80)
    for v in variants:
        pts = [(r["devices_used"], r["variants"][v]) for r in rows if "step_s" in r.get("variants", {}).get(v, {})]
        if not pts:
            continue
        x = [p[0] for p in pts]
        ax_t.plot(x, [p[1]["step_s"] for p in pts], marker="o", ms=3, label=v)
        ax_u.plot(x, [100 * p[1]["util"] for p in pts], marker="o", ms=3, label=v)
    unfit = [r["devices"] for r in rows if r.get("reason")]
    ticks = sorted({r["devices_used"] for r in rows if not r.get("reason")} | {r["devices"] for r in rows})
    for ax in (ax_t, ax_u):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=7, rotation=45)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("accelerators")
        ax.grid(True, which="both", alpha=0.3)
        if unfit:
            ax.axvspan(min(unfit) / 1.2, max(unfit) * 1.2, color="0.9", zorder=0)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("simulated step time (s)")
    ax_u.set_ylabel("accelerator utilization (%)")
    ax_u.set_ylim(bottom=0)
    ax_t.legend(fontsize=8)
    if unfit:
        ax_u.text(0.02, 0.97, f"grey: does not fit (<= {max(unfit)})", transform=ax_u.transAxes,
                  fontsize=8, va="top")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png")
    finally:
        plt.close(fig)
    replace_file(path, png.getvalue())


def bottleneck_table(rows: list[dict], variants: list[str]) -> str:
    """Per fitting count and variant, what the orchestrator and the network take: the share
    of the simulated time the orchestrator is charged for (1.0: it is the bottleneck) and the
    replicas' rank-seconds in weight syncs per rank-second generating."""
    lines = [f"{'accel':>6s} " + " ".join(f"{v + ': orch, sync/gen':>26s}" for v in variants)]
    for r in rows:
        if r["reason"]:
            continue
        cells = [f"{x['orchestrator_share']:11.2%} {x['sync_per_generate']:9.2f}"
                 if "orchestrator_share" in x else f"{'failed':>21s}" for x in (r["variants"][v] for v in variants)]
        lines.append(f"{r['devices_used']:6d} " + " ".join(f"{c:>26s}" for c in cells))
    return "\n".join(lines)
