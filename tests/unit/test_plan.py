"""config/plan.py: the config resolved once into an immutable Plan, and nothing else
re-resolving it (the AST scan below: production code outside config/plan.py and the pure
functions of config/resources.py it calls never calls a resolving function).

    pytest tests/unit/test_plan.py
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from flexmarl_hpc.config.load import load_config, load_plan
from flexmarl_hpc.config.plan import resolve
from flexmarl_hpc.config.schema import ConfigError
from tests.conftest import ROOT

RESOLVING = frozenset({"rollout_pools", "trainer_groups", "group_trainer_config", "layout_from_config",
                       "components", "single_component", "sync_groups"})
"""config/resources.py's and config/sync_groups.py's functions that resolve a config's pools,
groups, layout, components and sync groups: config/plan.resolve calls each once."""
ALLOWED = frozenset({"flexmarl_hpc/config/plan.py", "flexmarl_hpc/config/resources.py",
                     "flexmarl_hpc/config/sync_groups.py"})


def resolving_calls(root: Path) -> dict[str, list[str]]:
    """{file: ['line: name', ...]} of production calls of a RESOLVING function (by name or as
    an attribute, `resources.rollout_pools(cfg)`) outside ALLOWED, under `root`."""
    out: dict[str, list[str]] = {}
    for path in sorted((root / "flexmarl_hpc").rglob("*.py")):
        rel = str(path.relative_to(root))
        if rel in ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), rel)):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                if name in RESOLVING:
                    out.setdefault(rel, []).append(f"{node.lineno}: {name}")
    return out


def test_no_production_code_re_resolves_the_config():
    assert resolving_calls(ROOT) == {}


def test_the_scan_sees_a_call_by_name_and_by_attribute(tmp_path):
    pkg = tmp_path / "flexmarl_hpc" / "sim"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("from flexmarl_hpc.config import resources as r\n"
                              "def f(cfg):\n    return r.trainer_groups(cfg), layout_from_config(cfg, 1, 2)\n"
                              "def g(plan):\n    return plan.sync_groups, plan.pools\n")
    assert resolving_calls(tmp_path) == {"flexmarl_hpc/sim/x.py": ["3: trainer_groups", "3: layout_from_config"]}


def test_the_plan_holds_every_resolved_part_once():
    plan = load_plan(ROOT / "configs/hetero_cpu.yaml")
    assert isinstance(plan.pools, tuple) and isinstance(plan.groups, tuple) and isinstance(plan.sync_groups, tuple)
    assert [p.name for p in plan.pools] == ["big", "small"]
    assert [(t.backend, t.tensor_parallel, t.ranks_per_group, t.named_groups) for t in plan.trainers] == [
        ("megatron", 2, 2, []), ("torch", 1, 1, []), ("torch", 1, 1, [])]
    assert plan.layout.world_size == 8 and [c.name for c in plan.components][:3] == [
        "orchestrator", "pool big", "pool small"]
    assert {(s.group, s.pool) for s in plan.sync_groups} == {(0, 0), (1, 1), (2, 1)}
    assert plan.steps_in_flight == plan.cfg.pipeline.max_staleness + 2
    assert plan.bytes_per_weight(cuda=True) == plan.bytes_per_weight(cuda=False) == 4     # the torch engine: fp32


def test_the_plan_is_immutable():
    plan = load_plan(ROOT / "configs/local.yaml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.pools = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.groups[0].ranks = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.layout.replicas = 9
    with pytest.raises(TypeError):
        plan.sync_groups[0] = None


def test_every_field_of_the_plan_nested_config_included_refuses_a_change():
    """Not only the Plan: each dataclass in it (the config's sections, pools, groups, their
    slurm components) refuses an assignment and each list or mapping (workflow.turns,
    agents, sbatch_options, ...) a change, at any depth."""
    plan = load_plan(ROOT / "configs/hetero_cpu.yaml")    # pools, named groups, per-agent models
    todo, seen = [("plan", plan)], {"dataclass": 0, "list": 0, "dict": 0}
    while todo:
        path, obj = todo.pop()
        if dataclasses.is_dataclass(obj):
            seen["dataclass"] += 1
            for f in dataclasses.fields(obj):
                with pytest.raises(dataclasses.FrozenInstanceError):
                    setattr(obj, f.name, getattr(obj, f.name))
                todo.append((f"{path}.{f.name}", getattr(obj, f.name)))
        elif isinstance(obj, (list, dict)):
            seen["list" if isinstance(obj, list) else "dict"] += 1
            with pytest.raises(TypeError, match="read-only"):
                obj.append(None) if isinstance(obj, list) else obj.update(x=None)
            todo.extend((f"{path}[{k!r}]", v) for k, v in (obj.items() if isinstance(obj, dict) else enumerate(obj)))
        elif isinstance(obj, tuple):
            todo.extend((f"{path}[{i}]", v) for i, v in enumerate(obj))
    assert seen["dataclass"] >= 40 and seen["list"] >= 10 and seen["dict"] >= 3, seen


def test_bytes_per_weight_follow_the_engine_and_the_device():
    vllm = load_plan(ROOT / "configs/local.yaml", ["rollout.backend=vllm"])
    assert (vllm.bytes_per_weight(cuda=True), vllm.bytes_per_weight(cuda=False)) == (2, 4)   # auto: bf16 / fp32
    fp32 = load_plan(ROOT / "configs/local.yaml", ["rollout.backend=vllm", "rollout.dtype=fp32"])
    assert fp32.bytes_per_weight(cuda=True) == 4


def test_in_process_drops_only_the_tool_ranks():
    plan = load_plan(ROOT / "configs/math_team.yaml", ["model.checkpoint=", "tools.ranks=2"])
    assert plan.layout.tool_ranks > 0
    inproc = plan.in_process()
    assert inproc.layout.tool_ranks == 0 and inproc.layout.world_size == plan.layout.world_size - plan.layout.tool_ranks
    assert inproc.pools == plan.pools and inproc.sync_groups == plan.sync_groups
    assert all(c.role != "tools" for c in inproc.components)
    assert load_plan(ROOT / "configs/local.yaml").in_process().layout.tool_ranks == 0


def test_resolve_refuses_pools_and_groups_that_do_not_hold_together():
    """validate_resources runs on the very pools and groups the plan keeps."""
    cfg = load_config(ROOT / "configs/hetero_cpu.yaml")
    bad = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, named_groups=[
        dataclasses.replace(cfg.trainer.named_groups[0], ranks=3), *cfg.trainer.named_groups[1:]]))
    with pytest.raises(ConfigError, match=r"^trainer.named_groups\[0\].ranks: expected a multiple"):
        resolve(bad)
    groups = ("[{name: speaker, agents: [speaker], ranks: 3, tensor_parallel: 2, backend: megatron}, "
              "{name: relay, agents: [relay]}, {name: listener, agents: [listener]}]")
    with pytest.raises(ConfigError, match=r"^trainer.named_groups\[0\].ranks: expected a multiple"):
        load_plan(ROOT / "configs/hetero_cpu.yaml", [f"trainer.named_groups={groups}"])
