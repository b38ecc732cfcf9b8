"""Every malformed input is refused before launch: `config error: <field>: <expected>` on one
line, exit code 2, no traceback, no rank started (mpiexec is never exec'd) and nothing in
run.output_dir created or overwritten. The first 42 rows are issue 12's list (the ones that
crashed or were accepted, then the ones that already gave a clean error); the rest are ours.

`python -m pytest tests/unit/test_bad_inputs.py -q -rA` prints the table (input -> message)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.helpers import CASES, LOCAL, bad_input_args, refused_in_process

@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_refused_before_launch(case, tmp_path, capsys, monkeypatch):
    argv, field = bad_input_args(case, tmp_path)
    refused_in_process(case[0], argv, field, tmp_path, capsys, monkeypatch)


def test_output_dir_that_is_a_file(tmp_path, capsys, monkeypatch):
    """An existing regular file as run.output_dir (FileExistsError after launch): refused,
    the file untouched."""
    f = tmp_path / "afile"
    f.write_bytes(b"keep me\n")
    for out in (f, f / "sub"):
        refused_in_process(f"output_dir={out.name}", [LOCAL, f"run.output_dir={out}"],
                 f"run.output_dir: {f} exists and is not a folder", tmp_path, capsys, monkeypatch)
    assert f.read_bytes() == b"keep me\n"


def test_output_dir_not_writable_by_this_user(tmp_path, capsys, monkeypatch):
    """A folder the user may not write (mode 555). Root writes anywhere, and CI runs as root,
    so os.access answers for this folder as a user's kernel would."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: (not mode & os.W_OK and real(p, mode, **k))
                        if Path(p) == locked else real(p, mode, **k))
    refused_in_process("output_dir=locked/run", [LOCAL, f"run.output_dir={locked / 'run'}"],
             f"run.output_dir: {locked} is not writable by this user", tmp_path, capsys, monkeypatch)


def test_existing_run_is_not_touched(tmp_path, capsys):
    """A refused command pointed at a finished run's folder leaves every byte as it was."""
    from flexmarl_hpc.run import main
    out = tmp_path / "out"
    (out / "checkpoints" / "speaker").mkdir(parents=True)
    files = {out / "config.yaml": b"old config\n", out / "train.log": b"old log\n",
             out / "checkpoints" / "speaker" / "latest": b"v000003.pt"}
    for p, data in files.items():
        p.write_bytes(data)
    for bad in (["rollout.max_batch=0"], ["trainer.lr=.nan"], ["run.resume=false", "model.num_heads=0"]):
        assert main([LOCAL, f"run.output_dir={out}", *bad]) == 2
    capsys.readouterr()
    assert {p: p.read_bytes() for p in files} == files
    assert sorted(out.rglob("*")) == sorted({*files, out / "checkpoints", out / "checkpoints" / "speaker"})


# ---------------------------------------------------------------------------------------
# heterogeneous configs (rollout.pools, trainer.named_groups): refused before launch, each
# error naming the field
# ---------------------------------------------------------------------------------------
def _hetero(edit, base: str = "configs/hetero_cpu.yaml"):
    import yaml
    data = yaml.safe_load((ROOT / base).read_text())
    edit(data)
    return data


def _groups(d):
    return d["trainer"]["named_groups"]


def _set(node: dict, **kw):
    node.update(kw)


HETERO_CASES = [
    ("no_pool_serves_agent", lambda d: _set(d["rollout"]["pools"][1], agents=["relay"]),
     "rollout.pools: no pool can serve agent 'listener'"),
    ("agent_without_group", lambda d: _groups(d).pop(2),
     "trainer.named_groups: agent 'listener' has no trainer group"),
    ("swap_between_shapes", lambda d: (_set(_groups(d)[0], swap="x"), _set(_groups(d)[1], swap="x"),
                                       d.setdefault("pipeline", {}).update(swap_states=True)),
     "trainer.named_groups[1].swap: swap domain 'x' joins speaker (2 ranks, TP 2, PP 1, megatron) and "
     "relay (1 ranks, TP 1, PP 1, torch)"),
    ("tp_not_dividing_group", lambda d: _set(_groups(d)[0], ranks=3),
     "trainer.named_groups[0].ranks: expected a multiple of tensor_parallel x pipeline_parallel = 2, got 3"),
    ("tp_not_dividing_heads", lambda d: _set(_groups(d)[0], ranks=8, tensor_parallel=8),
     "trainer.named_groups[0].tensor_parallel: 8 does not divide the 4 heads / 4 KV heads of agent 'speaker'"),
    ("pp_not_dividing_layers", lambda d: _set(_groups(d)[0], ranks=8, pipeline_parallel=4),
     "trainer.named_groups[0].pipeline_parallel: 4 does not divide the 2 layers of agent 'speaker'"),
    ("tp_on_torch_group", lambda d: _set(_groups(d)[0], backend="torch"),
     "trainer.named_groups[0].tensor_parallel: tensor/pipeline parallelism needs backend megatron"),
    ("two_agents_without_swap", lambda d: (_groups(d)[1]["agents"].append("listener"), _groups(d).pop(2)),
     "pipeline.swap_states: trainer.named_groups[1] holds 2 agents"),
    ("agent_on_two_groups", lambda d: _groups(d)[1]["agents"].append("listener"),
     "trainer.named_groups[2].agents: agent 'listener' is already on trainer.named_groups[1]"),
    ("unknown_agent_in_pool", lambda d: d["rollout"]["pools"][0]["agents"].append("critic"),
     "rollout.pools[0].agents: no agent 'critic' in workflow.turns"),
    ("groups_and_named_groups", lambda d: _set(d["trainer"], groups=2),
     "trainer.groups: expected 0 with trainer.named_groups"),
    ("duplicate_pool_name", lambda d: _set(d["rollout"]["pools"][1], name="big"),
     "rollout.pools[1].name: pool name 'big' is used twice"),
]


@pytest.mark.parametrize("case", HETERO_CASES, ids=[c[0] for c in HETERO_CASES])
def test_bad_heterogeneous_config_isrefused_in_process(case, tmp_path):
    import yaml
    from flexmarl_hpc.config.schema import ConfigError
    from flexmarl_hpc.config.load import load_config
    _, edit, message = case
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_hetero(edit)))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert message in str(e.value)


def test_a_swap_domain_may_join_megatron_groups_of_other_tp_pp(tmp_path):
    """The move reshards between TP/PP layouts (runtime/reshard.py): two megatron groups of
    the same ranks, TP2 and PP2, share a swap label; other ranks are still refused."""
    import yaml
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.config.schema import ConfigError

    def edit(d, ranks=2):
        g = _groups(d)
        g[1].update(ranks=ranks, backend="megatron", pipeline_parallel=2, swap="x")
        g[0].update(swap="x")
        d.setdefault("pipeline", {}).update(swap_states=True)
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(_hetero(edit)))
    load_config(path)
    path.write_text(yaml.safe_dump(_hetero(lambda d: edit(d, ranks=4))))
    with pytest.raises(ConfigError, match=r"same ranks and backend"):
        load_config(path)


def test_megatron_options_follow_the_groups_backends(tmp_path):
    """trainer.precision etc. are megatron options: with named groups, one megatron group
    admits them (the global trainer.backend may stay torch); with none they are refused."""
    import yaml
    from flexmarl_hpc.config.schema import ConfigError
    from flexmarl_hpc.config.load import load_config
    ok = tmp_path / "ok.yaml"
    ok.write_text(yaml.safe_dump(_hetero(lambda d: _set(d["trainer"], precision="bf16", recompute="full"))))
    cfg = load_config(ok)
    assert cfg.trainer.backend == "torch" and cfg.trainer.precision == "bf16"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_hetero(lambda d: (_set(d["trainer"], precision="bf16"),
                                                    _set(_groups(d)[0], backend="torch", ranks=1,
                                                         tensor_parallel=1)))))
    with pytest.raises(ConfigError, match=r"trainer\.precision: needs a megatron trainer"):
        load_config(bad)


def test_pool_too_small_for_its_model_class(tmp_path):
    """A 32B agent (62 GB of bf16 weights) listed in the pool of 1 x 64 GB replicas."""
    import yaml
    from flexmarl_hpc.config.schema import ConfigError
    from flexmarl_hpc.config.load import load_config
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_hetero(lambda d: d["rollout"]["pools"][1]["agents"].append("shop32_0"),
                                           "configs/paper_3x32b_7x14b.yaml")))
    with pytest.raises(ConfigError, match=r"rollout\.pools\[1\]\.gpus_per_replica: pool too small for agent "
                                          r"'shop32_0': its model's weights take 62\.\d GB, a replica of 1 x 64 GB"):
        load_config(path)


def test_uniform_tp_must_divide_every_model():
    from flexmarl_hpc.config.schema import ConfigError
    from flexmarl_hpc.config.load import load_config
    with pytest.raises(ConfigError, match=r"trainer\.tensor_parallel: 8 does not divide the 4 heads / 4 KV heads of agent 'speaker'"):
        load_config(ROOT / "configs/local.yaml", ["trainer.backend=megatron", "trainer.tensor_parallel=8",
                                                  "trainer.ranks_per_group=8"])


def test_pool_component_errors_name_the_pool(tmp_path):
    from flexmarl_hpc.config.schema import ConfigError
    from flexmarl_hpc.submit import prepare
    import yaml
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_hetero(lambda d: _set(d["rollout"]["pools"][0], slurm={"nodes": 2}))))
    with pytest.raises(ConfigError, match=r"rollout\.pools\[0\]\.slurm\.nodes: 2 nodes for 1 tasks"):
        prepare(str(path), [f"run.output_dir={tmp_path}"])


# -- issue 38: episode workflows. Each of these gave a 33-line traceback (import errors, a
# non-UTF-8 dataset), launched and trained 0 samples with rc 0 (episode_args), or read a
# 2 GiB line whole (past 12 GiB) before the fix
EPISODE = ["workflow.agents=[planner,solver,verifier]", "workflow.turns=[]", "run.eval_every=0",
           "workflow.max_new_tokens=8", "model.max_seq_len=256"]
MATH_TEAM = "workflow.episode=flexmarl_hpc.workflows.math_team:episode"
EPISODE_CASES = [
    ("episode-raises-on-import", ["workflow.episode=boom_ep:episode"],
     "workflow.episode: importing 'boom_ep' raised RuntimeError: no GPU here (at {tmp}/boom_ep.py:3)"),
    ("episode-syntax-error", ["workflow.episode=broken_ep:episode"],
     "workflow.episode: 'broken_ep:episode': syntax error at {tmp}/broken_ep.py:2"),
    ("dataset-not-utf8", [MATH_TEAM, "workflow.dataset.train={tmp}/latin1.jsonl"],
     "{tmp}/latin1.jsonl:2: not UTF-8 (byte 0xe9"),
    ("episode_args-unknown", [MATH_TEAM, "workflow.episode_args={bogus: 1}"],
     "workflow.episode_args: unknown ['bogus'], expected some of ['extra_solver_cost', 'force_calculator']"),
    ("episode_args-wrong-type", [MATH_TEAM, "workflow.episode_args={extra_solver_cost: abc}"],
     "workflow.episode_args.extra_solver_cost: expected float, got 'abc'"),
    ("dataset-2GiB-line", [MATH_TEAM, "workflow.dataset.train={tmp}/huge.jsonl"],
     "{tmp}/huge.jsonl:2: a line longer than 16 MiB"),
]


def _episode_files(tmp: Path) -> None:
    """The episode modules and datasets the cases name (the 2 GiB line is a hole: no disk)."""
    (tmp / "boom_ep.py").write_text("import os\nX = 1\nraise RuntimeError('no GPU here')\n"
                                    "async def episode(ctx, example):\n    return {}\n")
    (tmp / "broken_ep.py").write_text("async def episode(ctx, example):\n    return {\n")
    good = '{"question": "1 + 1?", "answer": 2}\n'
    (tmp / "train.jsonl").write_text(good * 8)
    (tmp / "latin1.jsonl").write_bytes(good.encode() + '{"question": "café?", "answer": 1}\n'.encode("latin-1"))
    with open(tmp / "huge.jsonl", "wb") as f:
        f.write(good.encode() + b'{"question": "')
        f.seek(2 << 30)
        f.write(b'", "answer": 2}\n')


@pytest.mark.parametrize("case", EPISODE_CASES, ids=[c[0] for c in EPISODE_CASES])
def test_a_bad_episode_or_dataset_is_one_line_before_launch(case, tmp_path, capsys, monkeypatch):
    """rc 2, one line naming the file and line (or the key), no rank launched, nothing
    written; the episode module is imported in a child process (episode_check.py)."""
    name, spec, field = case
    _episode_files(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")       # no __pycache__ in tmp_path
    overrides = [s.replace("{tmp}", str(tmp_path)) for s in spec]
    if not any(o.startswith("workflow.dataset.train=") for o in overrides):
        overrides.append(f"workflow.dataset.train={tmp_path / 'train.jsonl'}")
    argv = [LOCAL, f"run.output_dir={tmp_path / 'out'}", *EPISODE, *overrides]
    refused_in_process(name, argv, field.replace("{tmp}", str(tmp_path)), tmp_path, capsys, monkeypatch)


