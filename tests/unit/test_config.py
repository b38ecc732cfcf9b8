import os

import pytest

from flexmarl_hpc.config.schema import Config, ConfigError
from flexmarl_hpc.config.load import apply_override, help_text, load_config, to_dict
from tests.conftest import ROOT
from tests.helpers import replaced_at

LOCAL = ROOT / "configs" / "local.yaml"


def test_local_config_loads_and_overrides_apply():
    cfg = load_config(LOCAL, ["trainer.lr=1e-4", "run.steps=7", "rollout.replicas=3"])
    assert cfg.trainer.lr == 1e-4 and cfg.run.steps == 7 and cfg.rollout.replicas == 3
    assert cfg.agent_names == ["speaker", "listener"]
    assert cfg.num_trainer_groups == 2


@pytest.mark.parametrize("override, field, expected", [
    ("trainer.lrr=1", "trainer.lrr", "unknown key"),
    ("trainer.lr=abc", "trainer.lr", "expected float"),
    ("run.mode=fast", "run.mode", "expected one of"),
    ("run.idle_wait=sleep", "run.idle_wait", "expected one of"),
    ("run.steps=0", "run.steps", "expected 1..1000000000"),
    ("rollout.replicas=0", "rollout.replicas", ">= 1 replica"),
    ("trainer.groups=1", "trainer.groups", "no trainer"),
    ("trainer.groups=3", "trainer.groups", "at most 2"),
    ("model.num_heads=5", "model.num_heads", "not divisible"),
    ("trainer.tensor_parallel=2", "trainer.ranks_per_group", "multiple of"),
    ("agents.critic={hidden_size: 8}", "agents.critic", "no such agent"),
    ("workflow.turns=[]", "workflow.turns", "at least one turn"),
    ("model.checkpoint=/nonexistent", "model.checkpoint", "does not exist"),
    ("pipeline.overprovision=-1", "pipeline.overprovision", "expected >= 0"),
    ("agents.critic={hidden_size:", "agents.critic", "not valid YAML"),
    (("pipeline.overprovision=2", "run.mode=sync"), "pipeline.overprovision", "needs run.mode=flex"),
    ("tools.ranks=1", "tools.ranks", "expected 0 without workflow.episode"),
    ("tools.ranks=-1", "tools.ranks", "expected 0..256"),
])
def test_bad_fields_are_named(override, field, expected):
    with pytest.raises(ConfigError) as e:
        load_config(LOCAL, list(override) if isinstance(override, tuple) else [override])
    assert str(e.value).startswith(field), str(e.value)
    assert expected in str(e.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(bad)


def test_override_syntax():
    d = {}
    apply_override(d, "a.b.c=[1, 2]")
    assert d == {"a": {"b": {"c": [1, 2]}}}
    with pytest.raises(ConfigError, match="key.path=value"):
        apply_override(d, "novalue")


def test_roundtrip_and_help():
    cfg = load_config(LOCAL)
    data = to_dict(cfg)
    assert data["trainer"]["betas"] == [0.9, 0.999]
    text = help_text(Config)
    assert "trainer.entropy_coef" in text and "Entropy bonus" in text


def test_bad_task_is_named(tmp_path):
    from flexmarl_hpc.workflows.build import build_task
    cfg = load_config(LOCAL, ["workflow.task=flexmarl_hpc.nope:Missing"])
    with pytest.raises(ConfigError, match="workflow.task: cannot import"):
        build_task(cfg)
    cfg = load_config(LOCAL, ["workflow.task_args={bogus: 1}"])
    with pytest.raises(ConfigError, match="workflow.task_args"):
        build_task(cfg)


def test_cli_reports_config_error_before_any_rank(tmp_path):
    import subprocess, sys
    p = subprocess.run([sys.executable, "-m", "flexmarl_hpc.run", str(LOCAL), "trainer.groups=1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "trainer.groups" in p.stderr and "launching" not in p.stdout


# ---------------------------------------------------------------------------------------
# heterogeneous resources (flexmarl_hpc/config/resources.py): pools and named trainer groups
# ---------------------------------------------------------------------------------------
OLD_CONFIGS = ["local", "relay3", "skewed", "smollm2_arith"]


@pytest.mark.parametrize("name", OLD_CONFIGS)
def test_old_configs_keep_their_layout_and_scripts(name):
    """The configs written before pools and named groups are the one-pool, uniform-group
    case: rank roles, colors, leaders, component sizes and both job scripts are byte for byte
    what the three-component code produced (tests/golden, written before the change)."""
    import json
    from flexmarl_hpc.config.load import load_plan
    from flexmarl_hpc.launch.sbatch import hetjob_script, single_script
    golden = ROOT / "tests/golden"
    ov = ["run.output_dir=/scratch/{name}", "model.checkpoint="]
    path = f"configs/{name}.yaml"
    plan = load_plan(ROOT / path, ov)
    lay = plan.layout
    want = json.loads((golden / "layouts.json").read_text())[name]
    assert lay.world_size == want["world_size"]
    assert list(lay.component_sizes) == want["component_sizes"]
    assert [list(lay.role_of(r)) for r in range(lay.world_size)] == want["roles"]
    assert [lay.split_color(r) for r in range(lay.world_size)] == want["colors"]
    assert [lay.group_leader(g) for g in range(lay.groups)] == want["leaders"]
    for kind, script in (("hetjob", hetjob_script), ("single", single_script)):
        text, file = script(plan, path, ov), golden / f"{kind}_{name}_config.sbatch"
        if os.environ.get("UPDATE_GOLDEN") == "1":      # after review, as tests/unit/test_slurm_scripts.py
            file.write_text(text)
        assert text == file.read_text()


def test_hetero_config_resolves_to_pools_groups_and_components():
    from flexmarl_hpc.config.load import load_plan
    plan = load_plan(ROOT / "configs/hetero_cpu.yaml")
    cfg = plan.cfg
    assert [(p.name, p.replicas, p.agents) for p in plan.pools] == [
        ("big", 1, ("speaker",)), ("small", 2, ("relay", "listener"))]
    groups = plan.groups
    assert [(g.name, g.ranks, g.tensor_parallel, g.backend) for g in groups] == [
        ("speaker", 2, 2, "megatron"), ("relay", 1, 1, "torch"), ("listener", 1, 1, "torch")]
    assert plan.trainers[0].tensor_parallel == 2 and plan.trainers[0].backend == "megatron"
    assert plan.trainers[1].tensor_parallel == 1 and plan.trainers[1].backend == "torch"
    assert cfg.model_for("speaker").hidden_size == 64 and cfg.model_for("relay").hidden_size == 32
    lay = plan.layout
    assert lay.component_sizes == (1, 1, 2, 2, 1, 1) and lay.world_size == 8
    assert [lay.role_of(r) for r in range(8)] == [
        ("orchestrator", 0), ("rollout", 0), ("rollout", 1), ("rollout", 2),
        ("trainer", 0), ("trainer", 0), ("trainer", 1), ("trainer", 2)]
    assert [lay.group_leader(g) for g in range(3)] == [4, 6, 7]
    assert [lay.pool_of(i) for i in range(3)] == [0, 1, 1] and lay.pool_replicas(1) == [1, 2]
    assert [c.name for c in plan.components] == ["orchestrator", "pool big", "pool small", "group speaker",
                                                 "group relay", "group listener"]


def test_pool_default_agents_are_those_whose_model_fits():
    """A pool without `agents` serves every agent whose weights fit its replicas."""
    from flexmarl_hpc.config.plan import resolve
    from flexmarl_hpc.config.resources import weight_gb
    cfg = load_config(ROOT / "configs/paper_3x32b_7x14b.yaml")
    assert 55 < weight_gb(cfg, "shop32_0") < 70 and 22 < weight_gb(cfg, "shop14_0") < 30
    cfg = replaced_at(cfg, "rollout.pools[1].agents", [])          # the 14B pool: 2 x 64 GB replicas
    pools = resolve(cfg).pools
    assert all(a.startswith("shop14") for a in pools[1].agents) and len(pools[1].agents) == 7


def test_state_swaps_stay_inside_a_swap_domain_of_one_shape():
    """Uniform groups form one domain (any group may take any agent, as before); named
    groups swap only with groups of the same label, which validation keeps to one shape."""
    from flexmarl_hpc.runtime.placement import initial_placement
    from flexmarl_hpc.config.load import load_plan
    from flexmarl_hpc.config.resources import swap_peers
    from flexmarl_hpc.runtime.state_swap import Location
    plan = load_plan(ROOT / "configs/relay3.yaml", ["trainer.groups=2", "pipeline.swap_states=true"])
    groups = plan.groups
    assert [g.agents for g in groups] == [("speaker", "listener"), ("relay",)]
    assert swap_peers(groups, 0) == [0, 1] and swap_peers(groups, 1) == [1, 0]
    assert initial_placement(groups, plan.cfg.agent_names) == {
        "speaker": Location(0, True), "relay": Location(1, True), "listener": Location(0, False)}
    groups_yaml = ("[{name: a, agents: [speaker], ranks: 2, tensor_parallel: 2, backend: megatron}, "
                   "{name: b, agents: [relay, listener], swap: small}, {name: c, swap: small}]")
    plan = load_plan(ROOT / "configs/hetero_cpu.yaml", [f"trainer.named_groups={groups_yaml}",
                                                        "pipeline.swap_states=true"])
    groups = plan.groups
    assert swap_peers(groups, 0) == [0] and swap_peers(groups, 1) == [1, 2] and swap_peers(groups, 2) == [2, 1]
    assert initial_placement(groups, plan.cfg.agent_names) == {
        "speaker": Location(0, True), "relay": Location(1, True), "listener": Location(1, False)}


@pytest.mark.parametrize("override, field, expected", [
    ("workflow.dataset.eval=", "workflow.dataset.eval", "expected a held-out file with run.eval_every=2"),
    ("run.eval_samples=2", "run.eval_samples", "expected 0 with workflow.episode"),
])
def test_episode_evaluation_needs_an_eval_file_and_is_greedy(tmp_path, override, field, expected):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1 + 1?", "answer": 2}\n')
    ov = ["model.checkpoint=", f"workflow.dataset.train={data}", f"workflow.dataset.eval={data}", "run.eval_every=2"]
    load_config(ROOT / "configs/math_team.yaml", ov)              # accepted as it is
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/math_team.yaml", [*ov, override])
    assert str(e.value).startswith(field) and expected in str(e.value), str(e.value)
