"""Every malformed input is refused before launch: `config error: <field>: <expected>` on one
line, exit code 2, no traceback, no rank started (mpiexec is never exec'd) and nothing in
run.output_dir created or overwritten. The first 42 rows are issue 12's list (the ones that
crashed or were accepted, then the ones that already gave a clean error); the rest are ours.

`python -m pytest tests/unit/test_bad_inputs.py -q -rA` prints the table (input -> message)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

LOCAL = str(ROOT / "configs" / "local.yaml")
NON_UTF8 = b"run:\n  name: caf\xe9\n"


def _alias_bomb(levels: int = 9) -> bytes:
    """The "billion laughs": level k is a list of 9 aliases of level k-1 (9^9 leaves)."""
    lines = ["    l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"    l{k}: &l{k} [" + ", ".join([f"*l{k - 1}"] * 9) + "]" for k in range(1, levels)]
    return ("workflow:\n  task_args:\n" + "\n".join(lines) + "\n").encode()


ALIAS_BOMB = _alias_bomb()
DEEP = b"run:\n  name: " + b"[" * 5000 + b"]" * 5000 + b"\n"
DUPLICATE_RUN = Path(LOCAL).read_bytes() + b"run:\n  steps: 3\n"     # replaced the first run: whole

# (case id, overrides or a config file's bytes, field the message must start with)
CASES = [
    # -- issue 12: crashed with a traceback (most after every rank had launched)
    ("non-utf8-file", NON_UTF8, "{file}"),
    ("num_heads=0", ["model.num_heads=0"], "model.num_heads"),
    ("num_kv_heads=0", ["model.num_kv_heads=0"], "model.num_kv_heads"),
    ("output_dir-{foo}", ["run.output_dir={tmp}/{foo}"], "run.output_dir"),
    ("log_every=0", ["run.log_every=0"], "run.log_every"),
    ("threads_per_rank=0", ["run.threads_per_rank=0"], "run.threads_per_rank"),
    ("chunk_rows=0", ["store.chunk_rows=0"], "store.chunk_rows"),
    ("max_batch=0", ["rollout.max_batch=0"], "rollout.max_batch"),
    ("hidden_size=0", ["model.hidden_size=0"], "model.hidden_size"),
    ("max_seq_len=2", ["model.max_seq_len=2"], "model.max_seq_len"),
    ("seed=-1", ["run.seed=-1"], "run.seed"),
    ("lr=nan", ["trainer.lr=.nan"], "trainer.lr"),
    # -- issue 12: nonsense that was accepted
    ("num_layers=-1", ["model.num_layers=-1"], "model.num_layers"),
    ("temperature=inf", ["rollout.temperature=.inf"], "rollout.temperature"),
    ("checkpoint_every=-3", ["run.checkpoint_every=-3"], "run.checkpoint_every"),
    ("steps=10**30", [f"run.steps={10**30}"], "run.steps"),
    ("replicas=100000-local", ["rollout.replicas=100000"], "rollout.replicas"),
    # -- issue 12: already clean (kept so they stay clean)
    ("unknown-key", ["trainer.lrr=1"], "trainer.lrr"),
    ("lr=abc", ["trainer.lr=abc"], "trainer.lr"),
    ("mode=fast", ["run.mode=fast"], "run.mode"),
    ("steps=0", ["run.steps=0"], "run.steps"),
    ("replicas=0", ["rollout.replicas=0"], "rollout.replicas"),
    ("groups=1-orphan", ["trainer.groups=1"], "trainer.groups"),
    ("groups=3", ["trainer.groups=3"], "trainer.groups"),
    ("num_heads=5", ["model.num_heads=5"], "model.num_heads"),
    ("tp=2-torch", ["trainer.tensor_parallel=2"], "trainer.ranks_per_group"),
    ("agents-unknown", ["agents.critic={hidden_size: 8}"], "agents.critic"),
    ("turns=[]", ["workflow.turns=[]"], "workflow.turns"),
    ("checkpoint-missing", ["model.checkpoint=/nonexistent"], "model.checkpoint"),
    ("overprovision=-1", ["pipeline.overprovision=-1"], "pipeline.overprovision"),
    ("override-bad-yaml", ["agents.critic={hidden_size:"], "agents.critic"),
    ("overprovision-sync", ["pipeline.overprovision=2", "run.mode=sync"], "pipeline.overprovision"),
    ("file-bad-yaml", b"run: [unclosed", "{file}"),
    ("file-top-list", b"- a list", "{file}"),
    ("task-no-colon", ["workflow.task=nope"], "workflow.task"),
    # -- issue 15: held-out evaluation
    ("eval_every=-1", ["run.eval_every=-1"], "run.eval_every"),
    ("eval_inputs=0", ["run.eval_inputs=0"], "run.eval_inputs"),
    ("eval_samples=-1", ["run.eval_samples=-1"], "run.eval_samples"),
    ("eval-task-without-heldout", ["workflow.task=tests.faulty_tasks:NoHeldoutGame"], "run.eval_every"),
    ("task-missing", ["workflow.task=flexmarl_hpc.nope:Missing"], "workflow.task"),
    ("task_args-bogus", ["workflow.task_args={bogus: 1}"], "workflow.task_args"),
    ("top_p=0", ["rollout.top_p=0"], "rollout.top_p"),
    ("backend=tpu", ["rollout.backend=tpu"], "rollout.backend"),
    ("bucket_mb=0", ["weight_sync.bucket_mb=0"], "weight_sync.bucket_mb"),
    ("bucket_mb-below-a-row", ["weight_sync.bucket_mb=0.0001"], "weight_sync.bucket_mb"),
    ("sync timeout<0", ["weight_sync.timeout_s=-1"], "weight_sync.timeout_s"),
    ("sync timeout=nan", ["weight_sync.timeout_s=.nan"], "weight_sync.timeout_s"),
    ("micro_batch_size=0", ["trainer.micro_batch_size=0"], "trainer.micro_batch_size"),
    ("max_staleness=-1", ["pipeline.max_staleness=-1"], "pipeline.max_staleness"),
    # -- ours: control characters in any string (they reach file names and the sbatch script)
    ("name-newline", ['run.name="x\\n"'], "run.name"),
    ("name-tab", ['run.name="a\\tb"'], "run.name"),
    ("name-CR", ['run.name="x\\r"'], "run.name"),
    ("account-NUL", ['slurm.account="a\\0"'], "slurm.account"),
    ("setup-newline", ['slurm.setup=["module load x\\nrm -rf /"]'], "slurm.setup[0]"),
    ("sbatch_options-newline", ['slurm.trainer.sbatch_options=["--exclusive\\n"]'],
     "slurm.trainer.sbatch_options[0]"),
    ("task_args-newline", ['workflow.task_args={num_objects: 8, note: "a\\nb"}'], "workflow.task_args.note"),
    ("output_dir-newline", ['run.output_dir="/tmp/a\\nb"'], "run.output_dir"),
    # -- ours: ranges of the other fields
    ("name-empty", ["run.name="], "run.name"),
    ("name-slash", ["run.name=a/b"], "run.name"),
    ("output_dir-empty", ["run.output_dir="], "run.output_dir"),
    ("steps-bool", ["run.steps=true"], "run.steps"),
    ("seed=2**64", [f"run.seed={2**64}"], "run.seed"),
    ("keep_checkpoints=0", ["run.keep_checkpoints=0"], "run.keep_checkpoints"),
    ("checkpoint_minutes=-1", ["run.checkpoint_minutes=-1"], "run.checkpoint_minutes"),
    ("checkpoint_minutes=nan", ["run.checkpoint_minutes=.nan"], "run.checkpoint_minutes"),
    ("inputs_per_step=0", ["workflow.inputs_per_step=0"], "workflow.inputs_per_step"),
    ("agent-name-slash", ["workflow.turns=[{agent: a/b}]"], "workflow.turns[0].agent"),
    ("intermediate_size=0", ["model.intermediate_size=0"], "model.intermediate_size"),
    ("rope_theta=0", ["model.rope_theta=0"], "model.rope_theta"),
    ("rms_eps=0", ["model.rms_eps=0"], "model.rms_eps"),
    ("init_std=-1", ["model.init_std=-1"], "model.init_std"),
    ("agent-num_kv_heads=0", ["agents.listener={num_kv_heads: 0}"], "agents.listener.num_kv_heads"),
    ("max_model_len=3", ["rollout.max_model_len=3"], "rollout.max_model_len"),
    ("top_p=1.5", ["rollout.top_p=1.5"], "rollout.top_p"),
    ("temperature=0", ["rollout.temperature=0"], "rollout.temperature"),
    ("lr=-1", ["trainer.lr=-1"], "trainer.lr"),
    ("lr=inf", ["trainer.lr=.inf"], "trainer.lr"),
    ("betas-1", ["trainer.betas=[0.9, 1.0]"], "trainer.betas[1]"),
    ("betas-short", ["trainer.betas=[0.9]"], "trainer.betas"),
    ("grad_clip=-1", ["trainer.grad_clip=-1"], "trainer.grad_clip"),
    ("clip_eps=0", ["trainer.clip_eps=0"], "trainer.clip_eps"),
    ("kl_coef=nan", ["trainer.kl_coef=.nan"], "trainer.kl_coef"),
    ("kl_coef with pp", ["trainer.backend=megatron", "trainer.ranks_per_group=2", "trainer.pipeline_parallel=2",
                         "trainer.kl_coef=0.1"], "trainer.kl_coef"),
    ("tis_cap=0", ["trainer.tis_cap=0"], "trainer.tis_cap"),
    ("pp=-1", ["trainer.pipeline_parallel=-1"], "trainer.pipeline_parallel"),
    ("groups=-1", ["trainer.groups=-1"], "trainer.groups"),
    ("ranks_per_group=0", ["trainer.ranks_per_group=0"], "trainer.ranks_per_group"),
    ("ranks_per_group=100000", ["trainer.ranks_per_group=100000"], "trainer.ranks_per_group"),
    ("rebalance_threshold=2", ["pipeline.rebalance_threshold=2"], "pipeline.rebalance_threshold"),
    ("rebalance_cooldown=-1", ["pipeline.rebalance_cooldown=-1"], "pipeline.rebalance_cooldown"),
    ("bucket_mb=1e9", ["weight_sync.bucket_mb=1e9"], "weight_sync.bucket_mb"),
    ("chunk_rows=1e9", [f"store.chunk_rows={10**9}"], "store.chunk_rows"),
    ("slurm-nodes=0", ["slurm.rollout.nodes=0"], "slurm.rollout.nodes"),
    ("signal_seconds=-1", ["slurm.signal_seconds=-1"], "slurm.signal_seconds"),
    ("override-no-equals", ["run.steps"], "override 'run.steps'"),
    # -- issue 27: YAML that hung (alias bomb) or tracebacked (RecursionError), or was silently merged
    ("yaml-alias-bomb", ALIAS_BOMB, "{file}: refused: aliases expand to more than 200000 nodes"),
    ("yaml-recursive-alias", b"run: &a {name: [*a]}\n", "{file}: refused: an alias refers to a node"),
    ("yaml-nested-5000", DEEP, "{file}: refused: nested deeper than 100 levels"),
    ("yaml-duplicate-top-level", DUPLICATE_RUN, "{file}: not valid YAML: duplicate key 'run' (first at line 7) at line"),
    ("yaml-duplicate-nested", b"trainer:\n  lr: 1.0e-3\n  lr: 2.0e-3\n",
     "{file}: not valid YAML: duplicate key 'lr' (first at line 2) at line 3"),
    ("override-duplicate-key", ["workflow.task_args={num_objects: 8, num_objects: 9}"],
     "workflow.task_args: the value"),
    ("unknown-keys-int-and-str", b"run:\n  1: a\n  zz: b\n", "run.1: unknown key"),
    # -- issue 27: a task's own arguments (ZeroDivisionError at launch, or accepted)
    ("num_objects=0", ["workflow.task_args={num_objects: 0, num_symbols: 8}"],
     "workflow.task_args.num_objects: expected an integer in 1..65536, got 0"),
    ("num_symbols=0", ["workflow.task_args.num_symbols=0"], "workflow.task_args.num_symbols"),
    ("num_objects=10**9", [f"workflow.task_args.num_objects={10**9}"], "workflow.task_args.num_objects"),
    ("num_objects-str", ['workflow.task_args.num_objects="8"'], "workflow.task_args.num_objects"),
    ("skewed-base_lengths-short", ["workflow.task=flexmarl_hpc.workflows.skewed:SkewedLengths",
                                   "workflow.task_args={base_lengths: [4]}"], "workflow.task_args.base_lengths"),
    ("user-task-raises", ["workflow.task=tests.faulty_tasks:DividingGame"],
     "workflow.task_args: tests.faulty_tasks:DividingGame(**{'num_objects': 32, 'num_symbols': 8}) raised "
     "ZeroDivisionError: division by zero ("),
    # -- issue 27: run.output_dir and names the file system refuses (ranks launched, then a traceback)
    ("name-300-chars", ["run.name=" + "n" * 300], "run.name: the name 'nnnn"),
    ("output_dir-component-300", ["run.output_dir={tmp}/" + "d" * 300 + "/x"], "run.output_dir: the name 'dddd"),
    ("output_dir-PATH_MAX", ["run.output_dir={tmp}/" + "/".join(["d" * 200] * 21)], "run.output_dir: the path"),
    # -- issue 27: the memory a local run needs (10**8 inputs grew to 6 GB before it was killed)
    ("inputs_per_step=10**8", [f"workflow.inputs_per_step={10**8}"],
     "workflow.inputs_per_step: the run needs about"),
    # -- issue 27: invisible characters beyond ASCII controls (U+0085 NEL got through)
    ("name-NEL", ['run.name="a\\u0085b"'], "run.name: unprintable character '\\x85' (U+0085, category Cc)"),
    ("name-RLO", ['run.name="a\\u202eb"'], "run.name: unprintable character '\\u202e' (U+202E, category Cf)"),
    ("name-ZWSP", ['run.name="a\\u200bb"'], "run.name"),
    ("name-NBSP", ['run.name="a\\u00a0b"'], "run.name: unprintable character '\\xa0' (U+00A0, category Zs)"),
    ("setup-LINE-SEPARATOR", ['slurm.setup=["module load x\\u2028rm -rf /"]'], "slurm.setup[0]"),
    ("task_args-PARAGRAPH-SEP", ['workflow.task_args={num_objects: 8, note: "a\\u2029b"}'],
     "workflow.task_args.note"),
]


def _args(case, tmp: Path) -> tuple[list[str], str]:
    """(argv, field prefix) of a case; output_dir is tmp/out unless the case sets it."""
    _, spec, field = case
    config = LOCAL
    overrides = [f"run.output_dir={tmp / 'out'}"]
    if isinstance(spec, bytes):
        config = str(tmp / "bad.yaml")
        Path(config).write_bytes(spec)
    else:
        overrides += [s.replace("{tmp}", str(tmp)) for s in spec]
    return [config, *overrides], field.replace("{file}", config)


def _nothing_launched_or_written(tmp: Path, before: set[Path]) -> None:
    after = set(tmp.rglob("*"))
    assert after == before, f"the refused run wrote {sorted(map(str, after - before))}"


def _refused(name: str, argv: list[str], field: str, tmp: Path, capsys, monkeypatch) -> None:
    """run.main(argv) in-process: rc 2, one line starting `config error: {field}`, no rank
    launched, nothing written under tmp."""
    from flexmarl_hpc import run
    from flexmarl_hpc.ranks import job

    def launched(*a, **k):
        raise AssertionError(f"ranks were launched: {a}")

    monkeypatch.setattr(os, "execv", launched)
    monkeypatch.setattr(job, "run_rank", launched)
    before = set(tmp.rglob("*"))
    rc = run.main(argv)
    out, err = capsys.readouterr()
    print(f"{name:26s} -> {err.strip()}")
    assert rc == 2, (rc, out, err)
    assert err.startswith(f"config error: {field}"), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "launching" not in out
    _nothing_launched_or_written(tmp, before)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_refused_before_launch(case, tmp_path, capsys, monkeypatch):
    argv, field = _args(case, tmp_path)
    _refused(case[0], argv, field, tmp_path, capsys, monkeypatch)


def test_output_dir_that_is_a_file(tmp_path, capsys, monkeypatch):
    """An existing regular file as run.output_dir (FileExistsError after launch): refused,
    the file untouched."""
    f = tmp_path / "afile"
    f.write_bytes(b"keep me\n")
    for out in (f, f / "sub"):
        _refused(f"output_dir={out.name}", [LOCAL, f"run.output_dir={out}"],
                 f"run.output_dir: {f} exists and is not a folder", tmp_path, capsys, monkeypatch)
    assert f.read_bytes() == b"keep me\n"


@pytest.fixture
def read_only_mount(tmp_path):
    """A tmpfs mounted read-only at tmp_path/ro (needs root and mount); unmounted after."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    try:
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], check=True)


@pytest.mark.parametrize("sub", ["", "run"])
def test_output_dir_on_a_read_only_mount(read_only_mount, sub, tmp_path, capsys, monkeypatch):
    """EROFS after every rank had started; now refused before, for the mount itself and for a
    folder to be created in it."""
    out = read_only_mount / sub if sub else read_only_mount
    _refused(f"output_dir=ro/{sub}", [LOCAL, f"run.output_dir={out}"],
             f"run.output_dir: {read_only_mount} is on a read-only file system", tmp_path, capsys, monkeypatch)


def test_output_dir_not_writable_by_this_user(tmp_path, capsys, monkeypatch):
    """A folder the user may not write (mode 555). Root writes anywhere, and CI runs as root,
    so os.access answers for this folder as a user's kernel would."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: (not mode & os.W_OK and real(p, mode, **k))
                        if Path(p) == locked else real(p, mode, **k))
    _refused("output_dir=locked/run", [LOCAL, f"run.output_dir={locked / 'run'}"],
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


SUBPROCESS_CASES = ["non-utf8-file", "num_heads=0", "lr=nan", "replicas=100000-local", "name-newline",
                    "yaml-alias-bomb", "yaml-nested-5000", "num_objects=0", "inputs_per_step=10**8"]


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_refused_from_the_command_line(name, tmp_path):
    """The real entry point: rc 2, one stderr line, no traceback, no mpiexec."""
    argv, field = _args(next(c for c in CASES if c[0] == name), tmp_path)
    before = set(tmp_path.rglob("*"))
    p = subprocess.run([sys.executable, "-m", "flexmarl_hpc.run", *argv], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.startswith(f"config error: {field}") and p.stderr.count("\n") == 1, p.stderr
    assert "launching" not in p.stdout and "Traceback" not in p.stderr
    _nothing_launched_or_written(tmp_path, before)


@pytest.fixture(scope="module")
def store_file(tmp_path_factory):
    """A small real run file (StoreFile, the writer of runs) with a few rows."""
    pytest.importorskip("h5py")
    from flexmarl_hpc.store.tables import StoreFile
    from flexmarl_hpc.store.schema import METRIC_COLUMNS
    path = tmp_path_factory.mktemp("store") / "r.h5"
    s = StoreFile(path, ["a"], {"config_yaml": "{}", "mode": "flex", "world_size": 3}, chunk=16)
    s.metrics.append({k: [0, 1] for k in METRIC_COLUMNS})
    s.flush()
    s.close()
    return path


@pytest.mark.parametrize("keep", [8, 9, 12, 20, 47, 0.5, -100])
def test_truncated_hdf5_to_analyze(store_file, tmp_path, keep):
    """Cut anywhere (inside the superblock too, where the reader used to hang or raise
    IndexError): one line naming the file, rc 2."""
    data = store_file.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (keep if keep > 0 else len(data) + keep)
    cut = tmp_path / "cut.h5"
    cut.write_bytes(data[:n])
    p = subprocess.run([sys.executable, "-m", "flexmarl_hpc.analyze", str(cut), "--no-plots"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    print(f"truncated to {n} bytes -> {p.stderr.strip()}")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.startswith(f"analyze: {cut}:") and p.stderr.count("\n") == 1, p.stderr
    assert "Traceback" not in p.stderr


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
def test_bad_heterogeneous_config_is_refused(case, tmp_path):
    import yaml
    from flexmarl_hpc.config.schema import ConfigError
    from flexmarl_hpc.config.load import load_config
    _, edit, message = case
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_hetero(edit)))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert message in str(e.value)


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
    _refused(name, argv, field.replace("{tmp}", str(tmp_path)), tmp_path, capsys, monkeypatch)


def test_the_episode_check_passes_good_args_and_bounds_a_hanging_import(tmp_path, monkeypatch):
    """Declared args of the right types pass (an int for a float field too), an episode
    without ARGS takes any args, and an import that hangs is one line, not a hung launcher."""
    from flexmarl_hpc.config.schema import ConfigError
    from flexmarl_hpc.workflows.episode_check import check_episode
    check_episode("flexmarl_hpc.workflows.math_team:episode", {"extra_solver_cost": 0.02})
    check_episode("flexmarl_hpc.workflows.math_team:episode", {"extra_solver_cost": 0})
    check_episode("tests.e2e.episodes:skewed", {"anything": [1, 2]})
    (tmp_path / "hangs_ep.py").write_text("import time\ntime.sleep(3600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^workflow.episode: importing 'hangs_ep:episode' did not finish in 3 s$"):
        check_episode("hangs_ep:episode", {}, timeout=3)
