"""Unit tests of the closed-form allocation planner (flexmarl_hpc/sim/plan.py) and of its plans
in a config's own terms (flexmarl_hpc/sim/plan_config.py)."""
from __future__ import annotations

import dataclasses

import pytest
import yaml

from flexmarl_hpc.config.plan import resolve
from flexmarl_hpc.config.load import load_plan
from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.sim.costs import QWEN25_14B, QWEN25_32B, AgentLayout, CostModel, TRAIN_STATE_BYTES_PER_PARAM
from flexmarl_hpc.sim.hardware import load_hardware
from flexmarl_hpc.sim.plan import (AgentClass, ClassAlloc, Workload, _Estimator, candidates, config_fragment,
                                   describe, group_sizes, main, parse_classes, rank_plans,
                                   replica_widths, _tp_for)
from flexmarl_hpc.sim.plan_config import (config_classes, distinct, fragment, fragment_nodes, fragment_yaml,
                                          merge_fragment, min_nodes, plan_nodes, plan_workload)
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def hw():
    return load_hardware("h100_ndr")


CLASSES = [AgentClass("q32", QWEN25_32B, 2), AgentClass("q14", QWEN25_14B, 3)]


def test_shapes_tried_hold_the_model(hw):
    assert replica_widths(hw, QWEN25_14B) == [1, 2]          # 29.5 GB fits one 80 GB GPU
    assert replica_widths(hw, QWEN25_32B) == [2, 4]          # 65.5 GB leaves no KV room on one
    assert group_sizes(hw, QWEN25_32B, 48)[0] >= 1
    npu = load_hardware("npu64_a3")
    assert replica_widths(npu, QWEN25_32B)[0] >= 2


def test_every_candidate_uses_exactly_the_nodes(hw):
    nodes = 16
    cands = candidates(hw, CLASSES, nodes)
    assert cands
    for allocs in cands:
        used = sum(a.pool_nodes + a.groups * a.group_nodes for _, a in allocs)
        assert used == nodes
        assert all(a.pool_nodes >= 1 and 1 <= a.groups for _, a in allocs)
        assert [n for n, _ in allocs] == ["q32", "q14"]
    no_swap = candidates(hw, CLASSES, nodes, swap=False)
    assert all(a.groups == c.count for allocs in no_swap for (_, a), c in zip(allocs, CLASSES))
    assert len(no_swap) < len(cands)


def test_step_estimates_are_sum_for_sync_and_overlap_for_flex(hw):
    plans = rank_plans(hw, CLASSES, Workload(), nodes=16, top=50)
    for p in plans:
        ph = p.phases.values()
        assert p.step_s["sync"] == pytest.approx(max(x["rollout"] for x in ph) + max(x["train"] for x in ph)
                                                 + max(x["sync"] for x in ph))
        assert p.step_s["flex"] <= p.step_s["sync"] + 1e-9
        assert p.step_s["flex"] >= max(max(x["rollout"], x["train"]) for x in ph)
        assert 0 < p.utilization["flex"] <= 1 and 0 < p.utilization["sync"] <= 1
    flex = [p.step_s["flex"] for p in plans]
    assert all(b >= a / 1.005 for a, b in zip(flex, flex[1:]))   # sorted up to the 0.5% tie band


def test_ranking_is_seeded_and_mode_specific(hw):
    a = rank_plans(hw, CLASSES, Workload(seed=3), nodes=14, top=3)
    b = rank_plans(hw, CLASSES, Workload(seed=3), nodes=14, top=3)
    assert [p.allocs for p in a] == [p.allocs for p in b]
    best_sync = rank_plans(hw, CLASSES, Workload(seed=3), nodes=14, mode="sync", top=1)[0]
    assert best_sync.step_s["sync"] <= min(p.step_s["sync"] for p in a)


def test_more_replicas_never_slow_rollout_and_swaps_cost_their_transfers(hw):
    est = _Estimator(hw, Workload(), CLASSES)
    times = [est.rollout("q14", n, 1)[0] for n in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True) and times[0] > times[-1]
    one, _, _, _ = est.train("q32", 1, 2)                     # 2 agents share one group
    two, _, _, _ = est.train("q32", 2, 2)                     # a group each
    devices = 2 * hw.devices_per_node
    lay = AgentLayout(QWEN25_32B, gpus_per_replica=2, trainer_devices=devices,
                      trainer_tp=_tp_for(hw, QWEN25_32B, devices))
    swap = CostModel(hw, {"a": lay}).swap_s("a", TRAIN_STATE_BYTES_PER_PARAM * QWEN25_32B.params)
    assert one == pytest.approx(2 * two + 2 * swap)


def test_too_few_nodes_is_one_clear_error(hw):
    with pytest.raises(ValueError, match="nodes: 3 nodes"):
        rank_plans(hw, CLASSES, Workload(), nodes=3)
    with pytest.raises(ValueError, match="mode"):
        rank_plans(hw, CLASSES, Workload(), nodes=16, mode="fast")


def test_config_fragment_names_every_agent_once_and_fills_the_nodes(hw):
    nodes = 16
    best = rank_plans(hw, CLASSES, Workload(), nodes=nodes, top=1)[0]
    frag = config_fragment(best, hw, CLASSES)
    pools, groups = frag["rollout"]["pools"], frag["trainer"]["named_groups"]
    served = sorted(a for p in pools for a in p["agents"])
    trained = sorted(a for g in groups for a in g["agents"])
    assert served == trained == sorted([f"q32_{i}" for i in range(2)] + [f"q14_{i}" for i in range(3)])
    devices = sum(p["replicas"] * p["gpus_per_replica"] for p in pools) + sum(g["ranks"] for g in groups)
    assert devices == nodes * hw.devices_per_node
    assert all(g["ranks"] % g["tensor_parallel"] == 0 for g in groups)
    text = describe(best, hw)
    assert "q32: pool" in text and "step: flex" in text


def test_an_allocation_can_be_evaluated_directly(hw):
    est = _Estimator(hw, Workload(), CLASSES)
    allocs = (("q32", ClassAlloc(4, 2, 2, 2, 4)), ("q14", ClassAlloc(2, 1, 3, 1, 2)))
    p = est.plan(allocs)
    assert p.nodes == 4 + 4 + 2 + 3
    starved = est.plan((allocs[0], ("q14", dataclasses.replace(allocs[1][1], pool_nodes=1))))
    assert starved.phases["q14"]["rollout"] > p.phases["q14"]["rollout"]


def test_cli_prints_plans_and_the_fragment_and_refuses_bad_input(capsys):
    assert main(["--hardware", "h100_ndr", "--nodes", "14", "--classes", "32b:1,14b:2", "--top", "2",
                 "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("step: flex") == 2 and '"named_groups"' in out
    assert main(["--classes", "7b:2"]) == 2
    assert "SIZE:COUNT" in capsys.readouterr().out
    assert main(["--hardware", "nope", "--nodes", "4"]) == 2
    assert "cannot read" in capsys.readouterr().out
    assert [c.count for c in parse_classes("32B:3, 14b:7")] == [3, 7]


# ---------------------------------------------------------------------------------------
# plans in a config's own terms (flexmarl_hpc/sim/plan_config.py)
# ---------------------------------------------------------------------------------------
PAPER = ROOT / "configs/paper_3x32b_7x14b.yaml"


@pytest.fixture(scope="module")
def paper():
    return load_config(PAPER)


def _load_merged(tmp_path, frag, source=PAPER):
    data = merge_fragment(yaml.safe_load(source.read_text()), frag)
    path = tmp_path / "merged.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_config(path)


def test_classes_are_the_configs_agents_grouped_by_model_shape(paper):
    classes = config_classes(resolve(paper))
    assert [(c.cls.name, c.cls.count) for c in classes] == [("p32", 3), ("p14", 7)]   # the config's pool names
    assert classes[0].agents == ("shop32_0", "shop32_1", "shop32_2")
    assert classes[1].agents == tuple(f"shop14_{i}" for i in range(7))
    assert classes[0].cls.model.params == QWEN25_32B.params        # priced with Qwen2.5's vocabulary
    assert classes[1].cls.model.params == QWEN25_14B.params
    # no pools in the config: one class named by the agents' common prefix, or cN
    local = config_classes(load_plan(ROOT / "configs/local.yaml"))
    assert [(c.cls.name, c.agents) for c in local] == [("c0", ("speaker", "listener"))]
    w = plan_workload(paper)
    assert (w.global_batch, w.micro_batch) == (64, 16)            # 16 inputs x 4 branches, the trainer's 16


def test_the_fragment_names_the_configs_agents_and_loads_back(paper, tmp_path):
    hw = load_hardware("npu64_a3")
    classes = config_classes(resolve(paper))
    nodes = 48
    best = rank_plans(hw, [c.cls for c in classes], plan_workload(paper), plan_nodes(paper, nodes), top=1)[0]
    frag = fragment(best, hw, classes, paper)
    pools, groups = frag["rollout"]["pools"], frag["trainer"]["named_groups"]
    agents = sorted(paper.agent_names)
    assert sorted(a for p in pools for a in p["agents"]) == agents
    assert sorted(a for g in groups for a in g["agents"]) == agents
    assert all(p["slurm"]["gpus_per_node"] == 16 and p["replicas"] * p["gpus_per_replica"]
               == 16 * p["slurm"]["nodes"] for p in pools)
    assert all(g["ranks"] == 16 * g["slurm"]["nodes"] for g in groups)
    assert fragment_nodes(frag) == best.nodes == nodes - 1            # the orchestrator keeps its node
    assert yaml.safe_load(fragment_yaml(frag, ["a comment"])) == frag
    cfg = _load_merged(tmp_path, frag)                               # validates pools, groups, TP
    assert [p.name for p in cfg.rollout.pools] == ["p32", "p14"]
    assert sum(c.slurm.nodes for c in resolve(cfg).components) <= nodes


def test_a_plan_with_fewer_groups_than_agents_swaps_and_still_validates(paper, tmp_path):
    hw = load_hardware("npu64_a3")
    classes = config_classes(resolve(paper))
    est = _Estimator(hw, plan_workload(paper), [c.cls for c in classes])
    plan = est.plan((("p32", ClassAlloc(8, 4, 3, 4, 8)), ("p14", ClassAlloc(6, 2, 2, 2, 4))))
    frag = fragment(plan, hw, classes, paper)
    groups = frag["trainer"]["named_groups"]
    assert [g["name"] for g in groups] == ["shop32_0", "shop32_1", "shop32_2", "p14_g0", "p14_g1"]
    assert groups[3]["agents"] == ["shop14_0", "shop14_2", "shop14_4", "shop14_6"] and groups[3]["swap"] == "p14"
    assert "swap" not in groups[0] and frag["pipeline"] == {"swap_states": True}
    cfg = _load_merged(tmp_path, frag)
    assert cfg.pipeline.swap_states and len(cfg.trainer.named_groups) == 5
    without = {k: v for k, v in frag.items() if k != "pipeline"}        # the swap needs the flag
    with pytest.raises(ConfigError, match="swap_states"):
        _load_merged(tmp_path, without)


def test_merging_replaces_lists_keeps_the_rest_and_leaves_the_input_alone():
    data = {"rollout": {"backend": "vllm", "pools": [{"name": "old"}]}, "run": {"steps": 3}}
    out = merge_fragment(data, {"rollout": {"pools": [{"name": "new"}]}, "pipeline": {"swap_states": True}})
    assert out == {"rollout": {"backend": "vllm", "pools": [{"name": "new"}]}, "run": {"steps": 3},
                   "pipeline": {"swap_states": True}}
    assert data["rollout"]["pools"] == [{"name": "old"}]


def test_min_nodes_counts_the_orchestrator_a_pool_node_and_a_group_per_class(paper):
    hw = load_hardware("npu64_a3")
    classes = config_classes(resolve(paper))
    least = min_nodes(hw, classes, paper)
    assert least == 1 + sum(1 + group_sizes(hw, c.cls.model, 48)[0] for c in classes)
    assert rank_plans(hw, [c.cls for c in classes], plan_workload(paper), plan_nodes(paper, least), top=1)
    with pytest.raises(ValueError):
        rank_plans(hw, [c.cls for c in classes], plan_workload(paper), plan_nodes(paper, least - 1), top=1)
    tiny = dataclasses.replace(hw, hbm_gb=2.0)                         # 16 x 2 GB cannot hold 32B
    with pytest.raises(ValueError, match=r"agents\.shop32_0: the 32\.8B model of agent 'shop32_0' fits no"):
        min_nodes(tiny, classes, paper)


def test_the_simulated_candidates_are_distinct_shapes_each_with_its_best_split(paper):
    hw = load_hardware("npu64_a3")
    classes = config_classes(resolve(paper))
    ranked = rank_plans(hw, [c.cls for c in classes], plan_workload(paper), 47, top=10**9)
    picked = distinct(ranked, 3)
    shapes = [tuple((a.gpus_per_replica, a.groups, a.group_nodes) for _, a in p.allocs) for p in picked]
    assert len(picked) == 3 and len(set(shapes)) == 3
    assert picked[0] is ranked[0]
    for p, shape in zip(picked, shapes):            # no better-ranked plan of the same shape was skipped
        first = next(q for q in ranked if tuple((a.gpus_per_replica, a.groups, a.group_nodes)
                                                for _, a in q.allocs) == shape)
        assert first is p
    assert distinct(ranked, 10**6) and len(distinct(ranked[:5], 10)) <= 5


def test_demand_aware_ranking_separates_pools_that_the_step_estimate_ties():
    """On 48 npu64 nodes the 32B pool at 18..25 nodes estimates the same flex step (decode is
    bounded by the longest response): the demand term tells them apart, and the chosen split
    gives each class the share of nodes closest to its share of the step's FLOPs (3 x 32.8B vs
    7 x 14.8B: ~48% / 52%)."""
    from flexmarl_hpc.sim.hardware import load_hardware
    from flexmarl_hpc.sim.plan import Workload, parse_classes, rank_plans
    hw = load_hardware("npu64_a3")
    plans = rank_plans(hw, parse_classes("32b:3,14b:7"), Workload(), 48, "flex", 10**6)
    best = plans[0]
    band = [p for p in plans if p.step_s["flex"] <= best.step_s["flex"] * 1.005]
    pools = {dict(p.allocs)["32b"].pool_nodes for p in band}
    assert {18, 25} <= pools                                   # the estimate ties them
    assert len({round(p.mismatch, 3) for p in band}) > 3          # the demand term does not
    assert best.mismatch == min(p.mismatch for p in band) < 0.05
    d32, n32 = best.shares()["32b"]
    assert d32 == pytest.approx(3 * 32.76 / (3 * 32.76 + 7 * 14.77), abs=0.01) and n32 == pytest.approx(d32, abs=0.02)
