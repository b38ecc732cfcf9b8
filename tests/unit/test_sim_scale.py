"""The scaling sweep: accelerator counts -> nodes -> the closed-form planner's allocation
(flexmarl_hpc/sim/scale.py, pure) and `simulate --scale` on a small sweep (unit: one process)."""
from __future__ import annotations

import json

import pytest
import yaml

from flexmarl_hpc.config.plan import resolve
from flexmarl_hpc import simulate
from flexmarl_hpc.sim import runs
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.sim.hardware import load_hardware
from flexmarl_hpc.sim.plan import rank_plans
from flexmarl_hpc.sim.plan_config import config_classes, plan_workload
from flexmarl_hpc.sim.scale import node_slice, parse_sizes, scale_points
from tests.conftest import ROOT

PAPER = ROOT / "configs/paper_5x32b.yaml"
LOCAL = str(ROOT / "configs/local.yaml")
TINY = ["workflow.inputs_per_step=2", "trainer.micro_batch_size=8"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_sizes_parse_sorted_and_bad_ones_name_the_flag():
    assert parse_sizes("4, 1,3072,2") == [1, 2, 4, 3072]
    for bad in ("0", "-4", "1,x", "", "1,,2", "2.5"):
        with pytest.raises(ValueError, match="--scale: expected"):
            parse_sizes(bad)
    with pytest.raises(ValueError, match="repeated"):
        parse_sizes("4,8,4")


def test_a_node_slice_keeps_each_devices_share_of_the_network():
    hw = load_hardware("npu64_a3")
    s = node_slice(hw, 4)
    assert (s.devices_per_node, s.nics_per_node, s.hbm_gb) == (4, 4, hw.hbm_gb)
    assert s.inter_node_bandwidth_per_device == hw.inter_node_bandwidth_per_device
    assert s.name != hw.name and node_slice(hw, 16) is hw
    with pytest.raises(ValueError, match="devices: expected 1..16"):
        node_slice(hw, 17)


def test_each_count_gets_its_nodes_and_the_planners_best_split_per_mode():
    cfg, hw = load_config(PAPER), load_hardware("npu64_a3")
    classes, work = config_classes(resolve(cfg)), plan_workload(cfg)
    pts = {p.devices: p for p in scale_points([1, 8, 16, 40, 64, 3072], hw, classes, work, cfg)}
    # 1 device: a 32B model fits no replica there; 8 devices: part of one node, and a pool and
    # a group need whole nodes; 16: one node of the 3 needed (pool node + 2-node 32B group)
    assert "fits no replica" in pts[1].reason and pts[1].hw.devices_per_node == 1
    assert "make one node" in pts[8].reason and "nodes of 8 devices" in pts[8].reason and pts[8].nodes == 1
    assert "needs >= 3 nodes = 48 accelerators" in pts[16].reason and not pts[16].plans
    # 40 devices take 3 whole nodes (48 devices), 3072 take 192
    assert (pts[40].nodes, pts[40].devices_used) == (3, 48) and pts[40].fits
    assert (pts[3072].nodes, pts[3072].devices_used) == (192, 3072)
    for n in (40, 64, 3072):
        p = pts[n]
        assert set(p.plans) == {"sync", "flex"}
        for mode, plan in p.plans.items():
            assert plan.nodes == p.nodes
            best = rank_plans(hw, [c.cls for c in classes], work, p.nodes, mode, top=1)[0]
            assert plan.allocs == best.allocs
    assert pts[3072].plans["flex"].step_s["flex"] <= pts[64].plans["flex"].step_s["flex"]
    only_flex = scale_points([64], hw, classes, work, cfg, modes=("flex",))[0]
    assert set(only_flex.plans) == {"flex"}
    # where the modes' best splits differ (3 x 32B + 7 x 14B on 8 nodes), each mode gets its own
    mixed = load_config(ROOT / "configs/paper_3x32b_7x14b.yaml")
    mixed_classes = config_classes(resolve(mixed))
    pt = scale_points([128], hw, mixed_classes, plan_workload(mixed), mixed)[0]
    for mode in ("sync", "flex"):
        best = rank_plans(hw, [c.cls for c in mixed_classes], plan_workload(mixed), 8, mode, top=1)[0]
        assert pt.plans[mode].allocs == best.allocs
    assert pt.plans["sync"].allocs != pt.plans["flex"].allocs


def test_cli_sweeps_sizes_writes_json_and_a_png(tmp_path, capsys):
    png = tmp_path / "scale.png"
    code = simulate.main(["scale", LOCAL, *TINY, "--hardware", "cpu_local", "--counts", "8,1,4", "--steps", "3",
                          "--variants", "sync,flex", "--json", "--png", str(png), "--out", str(tmp_path / "o")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    rows = json.loads(captured.out)["sizes"]
    assert [r["devices"] for r in rows] == [1, 4, 8]
    assert "does not fit" in rows[0]["reason"] and "variants" not in rows[0]
    for r in rows[1:]:
        assert r["reason"] == "" and r["nodes"] == r["devices"] // 2
        assert set(r["variants"]) == {"sync", "flex"}
        for v, x in r["variants"].items():
            assert x["step_s"] > 0 and 0 < x["util"] <= 1, (r["devices"], v)
            # what the network and the orchestrator take (the bottleneck table's figures)
            assert 0 < x["sync_per_generate"] < 10 and 0 <= x["orchestrator_share"] < 1, (r["devices"], v, x)
        # the simulated config holds the planner's split: its components fill the nodes
        frag = yaml.safe_load((tmp_path / "o" / str(r["devices"]) / "flex" / "config.yaml").read_text())
        used = (sum(p["slurm"]["nodes"] for p in frag["rollout"]["pools"])
                + sum(g["slurm"]["nodes"] for g in frag["trainer"]["named_groups"]))
        assert used == r["nodes"]
    assert rows[2]["variants"]["flex"]["step_s"] < rows[1]["variants"]["flex"]["step_s"]
    assert png.read_bytes()[:8] == PNG_MAGIC and not list(tmp_path.glob(".*.tmp"))


def test_cli_table_names_counts_and_variants(tmp_path, capsys):
    code = simulate.main(["scale", LOCAL, *TINY, "--hardware", "cpu_local", "--counts", "1,4", "--steps", "3",
                          "--variants", "flex,sync", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "does not fit" in out and "flex" in out and "sync" in out and "step_s" in out
    assert "flex: orch, sync/gen" in out and "sync: orch, sync/gen" in out
    # each variant is planned in its own mode: sync's barrier plan, flex's for every flex ablation,
    # the baselines' (verl, marti, mas-rl: synchronous loops) sync's
    assert [runs.variant_mode(v) for v in runs.VARIANTS] == ["sync"] + ["flex"] * 4 + ["sync"] * 3


@pytest.mark.parametrize("args, flag", [
    (["--counts", "0,4"], "--counts: expected"),
    (["--counts", "4,x"], "--counts: expected"),
    (["--counts", ""], "--counts: expected"),
    (["--counts", "4,4"], "--counts: a count is repeated"),
    (["--counts", "4", "--png", "/no/such/dir/x.png"], "--png: expected a .png path"),
    (["--counts", "4", "--png", "x.jpg"], "--png: expected a .png path"),
])
def test_bad_scale_flags_are_one_line_exit_2(tmp_path, capsys, args, flag):
    code = simulate.main(["scale", LOCAL, "--hardware", "cpu_local", *args, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and flag in err and len(err.strip().splitlines()) == 1, err


def test_when_no_count_fits_it_exits_1_and_draws_nothing(tmp_path, capsys):
    png = tmp_path / "scale.png"
    code = simulate.main(["scale", str(PAPER), "--counts", "1,16", "--png", str(png), "--out", str(tmp_path / "o")])
    captured = capsys.readouterr()
    assert code == 1 and "no accelerator count fits" in captured.err
    assert captured.out.count("does not fit") == 2 and not png.exists()


def test_a_failed_variant_is_shown_exits_1_and_the_rest_is_still_drawn(tmp_path, capsys, monkeypatch):
    real = runs.run_variants

    def stall_flex(config, variants, *a, **k):
        res = real(config, [v for v in variants if v != "flex"], *a, **k)
        return {**res, **({"flex": {"error": "waits with nothing in flight", "wall_s": 0.0}}
                          if "flex" in variants else {})}
    monkeypatch.setattr(runs, "run_variants", stall_flex)
    png = tmp_path / "scale.png"
    code = simulate.main(["scale", LOCAL, *TINY, "--hardware", "cpu_local", "--counts", "4", "--steps", "3",
                          "--variants", "sync,flex", "--png", str(png), "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert code == 1 and "failed" in out and png.read_bytes()[:8] == PNG_MAGIC
