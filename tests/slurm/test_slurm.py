"""Slurm: job scripts against golden files, config checks before submission, and real jobs
on a local Slurm cluster (scripts/slurm_up.sh: 8 virtual nodes on this host, and a `gpu`
partition of 48 x 16 GPUs that only `sbatch --test-only` uses).

    pytest tests/test_slurm.py -m "not slurm"     # pure: golden files, validation (~3 s)
    pytest tests/test_slurm.py -m slurm           # real Slurm; brings the cluster up (root)
    UPDATE_GOLDEN=1 pytest tests/test_slurm.py -k golden   # rewrite golden files after review

Without root or apt the real-Slurm tests skip with the reason; under CI=true they fail.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import h5py
import pytest

from flexmarl_hpc.config.schema import ConfigError, load_config
from flexmarl_hpc.launch.sbatch import Partition, check_capacity, hetjob_script, parse_time, single_script
from flexmarl_hpc.submit import (HetInfoWatcher, SlurmRun, main as submit_main, parse_sinfo, prepare,
                                 submit_sweep, sweep_overrides, sweep_parameters)
from tests.conftest import ROOT, need

GOLDEN = Path(__file__).parent / "golden"
CONFIG = str(ROOT / "configs/local.yaml")
# a 3-component site config: 1 orchestrator, 3 replicas on 3 GPU nodes, 2 groups x 2 ranks
SITE = ["run.output_dir=/scratch/flexmarl/{name}", "rollout.replicas=3", "trainer.ranks_per_group=2",
        "slurm.partition=gpu", "slurm.account=proj42", "slurm.qos=normal", "slurm.time=02:00:00",
        "slurm.mpi=pmix", "slurm.rollout={nodes: 3, gpus_per_node: 1, cpus_per_task: 8, mem: 64G}",
        "slurm.trainer={nodes: 2, gpus_per_node: 2, cpus_per_task: 8, mem: 128G, partition: gpu-large}",
        "slurm.setup=['module load cuda/12.4', 'source /opt/flexmarl/venv/bin/activate']"]
# the smallest real run: 2 agents (speaker, listener), 4 ranks, a few seconds per step on 2 cores
SMALL = ["workflow.inputs_per_step=4", "trainer.micro_batch_size=8", "model.hidden_size=32",
         "model.intermediate_size=64", "run.log_every=1"]
CONSUMED = 2


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; UPDATE_GOLDEN=1 rewrites it after review"


# ---------------------------------------------------------------------------------------
# (a) scripts, pure
# ---------------------------------------------------------------------------------------
def test_hetjob_script_matches_golden():
    cfg = load_config(CONFIG, SITE)
    text = hetjob_script(cfg, "configs/local.yaml", SITE, python="python")
    golden("hetjob_local.sbatch", text)
    header, _, body = text.partition("\n\n")
    comps = header.split("#SBATCH hetjob")
    assert len(comps) == 3
    assert [re.search(r"--ntasks=(\d+)", c).group(1) for c in comps] == ["1", "3", "4"]
    assert "--partition=gpu-large" in comps[2]
    # per-task GPU binding: each replica and trainer task gets its own GPU from Slurm
    assert [re.findall(r"--(?:gpus-per-task|gpus-per-node)=\d+", c) for c in comps] == [
        [], ["--gpus-per-task=1"], ["--gpus-per-task=1"]]
    assert [re.search(r"--ntasks-per-node=(\d+)", c).group(1) for c in comps] == ["1", "1", "2"]
    # one step over the 3 components, each with its --cpus-per-task (srun does not inherit it)
    assert "CMD=(python -m flexmarl_hpc.run configs/local.yaml " in body
    assert ('srun --mpi=pmix --het-group=0 --cpus-per-task=1 "${CMD[@]}" : --het-group=1 --cpus-per-task=8 '
            '"${CMD[@]}" : --het-group=2 --cpus-per-task=8 "${CMD[@]}"\n') in body
    assert "--signal=USR1@120" in comps[0] and "--open-mode=append" in comps[0]


def test_single_allocation_script_matches_golden():
    cfg = load_config(CONFIG, SITE)
    text = single_script(cfg, "configs/local.yaml", SITE, python="python")
    golden("single_local.sbatch", text)
    assert "hetjob" not in text and "--ntasks=8" in text and "--nodes=5" in text
    assert "#SBATCH --ntasks-per-node=2\n" in text and "#SBATCH --gpus-per-node=2\n" in text
    # roles share the nodes: the tasks see the node's GPUs, flexmarl_hpc.runtime.devices splits them
    assert 'srun --mpi=pmix --ntasks=8 --cpus-per-task=8 --gpu-bind=none "${CMD[@]}"\n' in text


def test_gpu_ranks_that_would_share_gpus_are_refused():
    # 3 replicas x 2 GPUs on 3 nodes of 1 GPU; 4 trainer ranks on 1 node of 2 GPUs
    with pytest.raises(ConfigError, match=r"^slurm.rollout.gpus_per_node: .* = 2 GPUs, but a node has 1"):
        hetjob_script(load_config(CONFIG, [*SITE, "rollout.gpus_per_replica=2"]), "c.yaml")
    with pytest.raises(ConfigError, match=r"^slurm.trainer.gpus_per_node: 4 tasks on 1 node"):
        hetjob_script(load_config(CONFIG, [*SITE, "slurm.trainer={nodes: 1, gpus_per_node: 2}"]), "c.yaml")
    # --single on 2 nodes of 4 GPUs: 4 ranks per node, replicas of 4 GPUs cannot fit
    single = [*SITE, "slurm.rollout={nodes: 1, gpus_per_node: 4}", "slurm.trainer={nodes: 1, gpus_per_node: 4}"]
    assert "--gpus-per-node=4" in single_script(load_config(CONFIG, single), "c.yaml")
    with pytest.raises(ConfigError, match=r"^slurm.trainer.gpus_per_node: --single puts 4 ranks"):
        single_script(load_config(CONFIG, [*single, "rollout.gpus_per_replica=4"]), "c.yaml")
    text = hetjob_script(load_config(CONFIG, [*single, "rollout.gpus_per_replica=4", "slurm.rollout={nodes: 3, gpus_per_node: 4}"]), "c.yaml")
    assert "#SBATCH --gpus-per-task=4\n" in text                  # a replica's contiguous block
    with pytest.raises(ConfigError, match=r"^rollout.gpus_per_replica"):
        load_config(CONFIG, ["rollout.gpus_per_replica=0"])


def test_dry_run_prints_the_script_with_absolute_paths(tmp_path, capsys):
    assert submit_main([CONFIG, "--dry-run", f"run.output_dir={tmp_path}", "--no-partition-check"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash") and "srun --mpi=pmi2 --het-group=0 --cpus-per-task=1 " in out
    assert f"#SBATCH --output={tmp_path}/logs/%j.out" in out and f"run.output_dir={tmp_path}" in out
    assert not (tmp_path / "job.sbatch").exists(), "a dry run writes nothing"


def test_sbatch_options_go_to_their_component():
    cfg = load_config(CONFIG, [*SITE, "slurm.sbatch_options=['--mail-type=END']",
                               "slurm.trainer.sbatch_options=['--constraint=a100', '--exclusive']"])
    comps = hetjob_script(cfg, "c.yaml").partition("\n\n")[0].split("#SBATCH hetjob")
    assert "#SBATCH --mail-type=END\n" in comps[0] and "--mail-type" not in comps[1] + comps[2]
    assert comps[2].endswith("#SBATCH --constraint=a100\n#SBATCH --exclusive")
    assert "--constraint" not in comps[0] + comps[1]
    single = single_script(cfg, "c.yaml")
    assert all(f"#SBATCH {o}\n" in single for o in ("--mail-type=END", "--constraint=a100", "--exclusive"))
    extra = sweep_parameters(cfg)["additional_parameters"]
    assert {k: extra[k] for k in ("mail-type", "constraint", "exclusive")} == {
        "mail-type": "END", "constraint": "a100", "exclusive": True}


# ---------------------------------------------------------------------------------------
# (b) a bad slurm: section is refused before submission
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, field", [
    ("slurm.time=1h", "slurm.time"),
    ("slurm.time=0", "slurm.time"),
    ("slurm.time=10:75:00", "slurm.time"),
    ("slurm.mpi=openmpi", "slurm.mpi"),
    ("slurm.signal_seconds=-5", "slurm.signal_seconds"),
    ("slurm.signal_seconds=600", "slurm.signal_seconds"),          # >= the 5 min limit below
    ("slurm.account=a b", "slurm.account"),
    ("slurm.rollout={nodes: 0}", "slurm.rollout.nodes"),
    ("slurm.rollout={nodes: 5}", "slurm.rollout.nodes"),
    ("slurm.trainer={gpus_per_node: -1}", "slurm.trainer.gpus_per_node"),
    ("slurm.trainer={cpus_per_task: 0}", "slurm.trainer.cpus_per_task"),
    ("slurm.trainer={mem: lots}", "slurm.trainer.mem"),
    ("slurm.trainer={gpus: 4}", "slurm.trainer.gpus"),
    ("run.name=my run", "run.name"),
    ("slurm.trainer.sbatch_options=['-C a100']", "slurm.trainer.sbatch_options"),
    ("slurm.rollout.sbatch_options=['--nodes=2']", "slurm.rollout.sbatch_options"),
    ("slurm.sbatch_options=['--time=5']", "slurm.sbatch_options"),
    ("slurm.sbatch_options=['--comment=a b']", "slurm.sbatch_options"),
])
def test_bad_slurm_section_is_refused_before_submission(override, field, tmp_path, capsys):
    args = [override, "slurm.time=00:05:00", f"run.output_dir={tmp_path}"] if override.startswith(
        "slurm.signal") else [override, f"run.output_dir={tmp_path}"]
    with pytest.raises(ConfigError, match=f"^{re.escape(field)}"):
        prepare(CONFIG, args)
    assert submit_main([CONFIG, *args, "--no-partition-check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: {field}"), err
    assert not (tmp_path / "job.sbatch").exists() and not (tmp_path / "config.yaml").exists()


PARTS = {"cpu": Partition(nodes=4, cpus=4, gpus=0, mem_mb=4000),
         "gpu": Partition(nodes=2, cpus=16, gpus=4, mem_mb=256000)}


@pytest.mark.parametrize("override, field", [
    ("slurm.partition=nope", "slurm.partition"),
    ("slurm.trainer={partition: nope}", "slurm.trainer.partition"),
    ("slurm.trainer={cpus_per_task: 3}", "slurm.trainer.cpus_per_task"),     # 2 ranks x 3 > 4
    ("slurm.rollout={gpus_per_node: 1}", "slurm.rollout.gpus_per_node"),     # cpu nodes have none
    ("slurm.trainer={mem: 8G}", "slurm.trainer.mem"),
    ("slurm.trainer={nodes: 2, partition: gpu, gpus_per_node: 8}", "slurm.trainer.gpus_per_node"),
])
def test_components_that_no_node_can_hold_are_refused(override, field):
    cfg = load_config(CONFIG, [override])
    with pytest.raises(ConfigError, match=f"^{re.escape(field)}"):
        check_capacity(cfg, PARTS, default="cpu")


def test_capacity_check_accepts_what_fits():
    check_capacity(load_config(CONFIG, ["slurm.trainer={cpus_per_task: 2}"]), PARTS, default="cpu")
    check_capacity(load_config(CONFIG, ["slurm.trainer={partition: gpu, gpus_per_node: 2, cpus_per_task: 8}"]),
                   PARTS, default="cpu")


def test_parsers():
    assert [parse_time(t) for t in ("90", "5:30", "02:00:00", "1-12", "1-0:30:05", "UNLIMITED")] == \
        [5400, 330, 7200, 129600, 88205, None]
    parts, default = parse_sinfo("debug*|4|4|4000|(null)\ngpu|2|64|512000+|gpu:a100:4(S:0-1)\n"
                                 "gpu|1|32|256000|gpu:8\n")
    assert default == "debug" and parts["debug"] == Partition(4, 4, 0, 4000)
    assert parts["gpu"] == Partition(3, 64, 8, 512000)
    # sacct lists a het job as J+0, J+1...: the watcher answers for J with component 0
    info = HetInfoWatcher().read_info("JobID|State|NodeList\n7+0|RUNNING|n1\n7+0.batch|RUNNING|n1\n"
                                      "7+1|RUNNING|n2\n8|PENDING|None\n")
    assert info["7"]["State"] == "RUNNING" and info["8"]["State"] == "PENDING"
    assert sweep_overrides(["a=1", "trainer.lr=9"], "trainer.lr=1e-3,3e-4", Path("/o")) == [
        ["a=1", "trainer.lr=1e-3", "run.output_dir=/o/trainer.lr=1e-3"],
        ["a=1", "trainer.lr=3e-4", "run.output_dir=/o/trainer.lr=3e-4"]]
    with pytest.raises(ConfigError, match="--sweep"):
        sweep_overrides([], "trainer.lr", Path("/o"))


# ---------------------------------------------------------------------------------------
# real Slurm
# ---------------------------------------------------------------------------------------
def _sinfo_ok() -> bool:
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def slurm() -> set[str]:
    """A working Slurm; returns its partition names. Brings up (or re-checks, ~1 s) the
    local cluster of scripts/slurm_up.sh; a site's own Slurm is used as it is."""
    ours = (ROOT / ".slurm-local" / "slurmctld.pid").exists()
    if ours or not _sinfo_ok():
        # slurm_up.sh checks a running cluster without root; only a bring-up needs root + apt
        need(ours or os.geteuid() == 0, "a local Slurm cluster (scripts/slurm_up.sh needs root)")
        need(ours or shutil.which("apt-get") is not None or shutil.which("slurmctld") is not None,
             "a local Slurm cluster (scripts/slurm_up.sh needs apt-get)")
        t0 = time.time()
        p = subprocess.run(["bash", "scripts/slurm_up.sh"], cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
        need(p.returncode == 0, f"a local Slurm cluster: scripts/slurm_up.sh exited {p.returncode}\n"
                                f"{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
        print(f"[slurm] scripts/slurm_up.sh: {time.time() - t0:.1f} s")
    need(_sinfo_ok(), "sinfo (Slurm controller reachable)")
    return set(parse_sinfo(subprocess.run(["sinfo", "-h", "-o", "%P|%D|%c|%m|%G"], capture_output=True,
                                          text=True, timeout=20).stdout)[0])


def _wait_for(cond, timeout: float, what: str, poll: float = 0.5):
    t0 = time.monotonic()
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


def _steps_logged(run: SlurmRun) -> int:
    text = run.paths.stdout.read_text() if run.paths.stdout.exists() else ""
    return max((int(m) for m in re.findall(r"step\s+(\d+)/", text)), default=0)


def assert_store_complete(h5: Path, steps: int) -> None:
    """Every sample consumed exactly once: in /samples/<agent> every row has status 2
    (consumed) and no sample_id repeats; /steps/<agent> has one row per step."""
    with h5py.File(h5, "r") as f:
        agents = list(f.attrs["agents"])
        assert agents == ["speaker", "listener"]
        for agent in agents:
            g = f[f"samples/{agent}"]
            ids = g["sample_id"][:]
            assert len(ids) > 0
            assert len(ids) == len(set(ids.tolist())), f"{agent}: a sample_id appears twice"
            assert (g["status"][:] == CONSUMED).all(), f"{agent}: a sample was not consumed"
            st = f[f"steps/{agent}"]
            assert st["step"].shape[0] == steps, f"{agent}: {st['step'].shape[0]} step rows, want {steps}"
            assert st["step"][:].tolist() == list(range(steps))
    try:                                              # the runtime's deeper check, when present
        from tests.test_run import check_exactly_once
    except ImportError:
        return
    check_exactly_once(h5, steps)


@pytest.mark.slurm
def test_submit_runs_a_het_job_to_completion(slurm, tmp_path, capsys):
    """(c) submit -> one het job of 3 components -> a complete store."""
    assert submit_main([CONFIG, *SMALL, "run.steps=4", f"run.output_dir={tmp_path}",
                        "slurm.sbatch_options=['--comment=flexmarl-test']"]) == 0
    out = capsys.readouterr().out
    job_id = re.search(r"submitted job (\d+)", out).group(1)
    for path in (f"{tmp_path}/logs/{job_id}.out", f"{tmp_path}/logs/{job_id}.err", f"{tmp_path}/local.h5"):
        assert path in out
    run = SlurmRun(tmp_path, job_id)                  # reattach to the id, as a user would
    h5 = run.result(timeout=150)
    assert h5 == tmp_path / "local.h5"
    assert_store_complete(h5, 4)
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "job.sbatch").exists()
    assert f"job {job_id} restart 0" in run.stdout()
    p = subprocess.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State,NNodes"],
                       capture_output=True, text=True, timeout=30)
    comps = {line.split("|")[0]: line.split("|")[1] for line in p.stdout.split()}
    assert comps == {f"{job_id}+{i}": "COMPLETED" for i in range(3)}, p.stdout
    p = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    assert "Comment=flexmarl-test" in p.stdout, p.stdout        # slurm.sbatch_options reached sbatch


@pytest.mark.slurm
@pytest.mark.parametrize("how", ["signal", "preempt"])
def test_interrupted_job_is_requeued_and_finishes_exactly_once(slurm, how, tmp_path):
    """(d) mid-run, the job is signalled (scancel --signal=USR1 --full) or preempted by a
    job in the `high` partition: it checkpoints, exits 75, is requeued, and the requeued
    job (SLURM_RESTART_COUNT=1) finishes the run with every sample consumed exactly once."""
    if how == "preempt":
        need("high" in slurm, "a `high` partition that preempts the default one (scripts/slurm_up.sh)")
    steps = 300                                       # ~40 ms each: the signal lands mid-run
    run = submit_from_test(tmp_path, steps)
    _wait_for(lambda: _steps_logged(run) >= 3, 120, "3 steps")
    if how == "signal":
        run.signal("USR1", full=True)                 # the batch shell traps it; the ranks act
    else:
        # every CPU of every node: Slurm must preempt (SIGTERM, GraceTime 30 s, requeue)
        nodes = subprocess.run(["sinfo", "-h", "-p", "high", "-o", "%D"], capture_output=True, text=True,
                               timeout=20).stdout.split()[0]
        p = subprocess.run(["sbatch", "--parsable", "-p", "high", "-N", nodes, "--exclusive", "-o", "/dev/null",
                            "--wrap", "sleep 1"], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, p.stderr
    _wait_for(lambda: "ranks exited 75" in run.stdout(), 90, "the checkpoint and exit 75")
    h5 = run.result(timeout=180)                      # wait() releases the requeue hold
    log = run.stdout()
    assert f"job {run.job_id} restart 1" in log and "resumed at versions" in log, log[-3000:]
    assert _steps_logged(run) == steps
    assert_store_complete(h5, steps)


@pytest.mark.slurm
def test_sweep_runs_one_array_task_per_value(slurm, tmp_path):
    """--sweep trainer.lr=1e-3,3e-4: one submitit job array, each task one allocation
    running its own value into BASE/key=value to a complete store."""
    tasks = submit_sweep(CONFIG, [*SMALL, "run.steps=2", f"run.output_dir={tmp_path}"], "trainer.lr=1e-3,3e-4")
    assert [t.output_dir for t in tasks] == [tmp_path / "trainer.lr=1e-3", tmp_path / "trainer.lr=3e-4"]
    assert len({t.job.job_id.split("_")[0] for t in tasks}) == 1       # one array
    for task, lr in zip(tasks, (1e-3, 3e-4)):
        state = SlurmRun(task.output_dir, task.job.job_id).wait(timeout=180)
        assert state == "COMPLETED", task.job.paths.stderr.read_text()[-3000:]
        h5 = task.output_dir / "local.h5"
        assert Path(task.job.results()[0]) == h5
        assert_store_complete(h5, 2)
        assert load_config(str(task.output_dir / "config.yaml")).trainer.lr == lr


@pytest.mark.slurm
def test_signalled_sweep_task_requeues_and_resumes(slurm, tmp_path):
    """A sweep task signalled mid-run (USR2, submitit's preemption signal) checkpoints,
    requeues itself and resumes from its output_dir to a complete store."""
    steps = 300                                       # ~40 ms each: the signal lands mid-run
    (task,) = submit_sweep(CONFIG, [*SMALL, f"run.steps={steps}", f"run.output_dir={tmp_path}"], "trainer.lr=1e-3")
    log = task.job.paths.stdout
    _wait_for(lambda: log.exists() and re.search(r"step\s+3/", log.read_text()), 120, "3 steps")
    p = subprocess.run(["scancel", "--signal=USR2", task.job.job_id], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert SlurmRun(task.output_dir, task.job.job_id).wait(timeout=240) == "COMPLETED"
    text = log.read_text()
    assert "preemption signal" in text and "resumed at versions" in text, text[-3000:]
    assert_store_complete(task.output_dir / "local.h5", steps)


def submit_from_test(tmp_path: Path, steps: int) -> SlurmRun:
    from flexmarl_hpc.submit import submit
    return submit(CONFIG, [*SMALL, f"run.steps={steps}", f"run.output_dir={tmp_path}"])



@pytest.mark.slurm
def test_sbatch_templates_run_as_written(slurm, tmp_path):
    """slurm/*.sbatch, submitted with plain sbatch (only the output folder and the venv
    path moved to tmp), run a short training to a complete store."""
    runs = []
    for name in ("flexmarl_hetjob.sbatch", "flexmarl_single.sbatch"):
        out = tmp_path / name.split(".")[0]
        (out / "logs").mkdir(parents=True)
        text = (ROOT / "slurm" / name).read_text().replace("runs/flexmarl", str(out)).replace(
            "source .venv/bin/activate", f"source {ROOT}/.venv/bin/activate")
        (out / name).write_text(text)
        env = {**os.environ, "CONFIG": CONFIG, "EXTRA": " ".join([*SMALL, "run.steps=2"])}
        p = subprocess.run(["sbatch", "--parsable", str(out / name)], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        runs.append(SlurmRun(out, p.stdout.strip().split(";")[0], out / "local.h5"))
    for run in runs:
        assert_store_complete(run.result(timeout=150), 2)
    assert "--het-group" in (ROOT / "slurm/flexmarl_hetjob.sbatch").read_text()


# ---------------------------------------------------------------------------------------
# (e) heterogeneous agents: the paper's 48 x 16 GPU job, judged by a real slurmctld
# ---------------------------------------------------------------------------------------
PAPER = str(ROOT / "configs/paper_3x32b_7x14b.yaml")


@pytest.mark.slurm
def test_paper_config_is_accepted_by_sbatch_test_only(slurm, tmp_path, capsys):
    """configs/paper_3x32b_7x14b.yaml (13 components, 561 ranks, 752 GPUs on 48 nodes x 16 GPUs)
    as `submit` writes it: slurmctld's own scheduler says when it would start (the local
    cluster's `gpu` partition: 48 State=CLOUD nodes with Gres=gpu:16, scripts/slurm_up.sh).
    The same script asking one GPU too many per replica is refused: the test can fail."""
    need("gpu" in slurm, "a Slurm partition `gpu` of 48 nodes x 16 GPUs (scripts/slurm_up.sh)")
    ov = [f"run.output_dir={tmp_path}"]
    assert submit_main([PAPER, *ov, "--dry-run"]) == 0      # partitions checked against sinfo
    out = capsys.readouterr()
    assert "total           561      48     752" in out.err
    script = tmp_path / "job.sbatch"
    script.write_text(out.out)
    assert out.out.count("#SBATCH hetjob") == 12
    p = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "to start at" in p.stderr, p.stderr
    bad = tmp_path / "bad.sbatch"
    bad.write_text(out.out.replace("--gpus-per-task=4", "--gpus-per-task=5"))
    p = subprocess.run(["sbatch", "--test-only", str(bad)], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "not available" in p.stderr, p.stderr


HETERO = str(ROOT / "configs/hetero_cpu.yaml")


@pytest.mark.slurm
def test_hetero_cpu_runs_as_a_six_component_het_job(slurm, tmp_path):
    """configs/hetero_cpu.yaml on the local Slurm: 6 components (orchestrator, 2 pools, 3
    trainer groups, one of them megatron TP 2), every sample trained exactly once."""
    from flexmarl_hpc.config.schema import load_config
    from tests.test_run import check_exactly_once, check_group_intervals
    ov = ["run.steps=4", f"run.output_dir={tmp_path}", "run.log_every=1"]
    cfg = load_config(HETERO, ov)
    assert submit_main([HETERO, *ov, "--wait", "--timeout", "900"]) == 0
    script = next((tmp_path / "logs").glob("*.sbatch")).read_text()
    assert script.count("#SBATCH hetjob") == 5
    h5 = tmp_path / "hetero_cpu.h5"
    check_exactly_once(h5, 4)
    check_group_intervals(h5, cfg)


def test_dry_run_prints_the_component_table_on_stderr(tmp_path, capsys):
    """stdout stays the script (`--dry-run > job.sbatch`); stderr has one row per component
    with its ranks, nodes, GPUs and agents."""
    assert submit_main([HETERO, f"run.output_dir={tmp_path}", "--dry-run", "--no-partition-check"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("#!/bin/bash\n") and out.out.count("#SBATCH hetjob") == 5
    rows = [line.replace("pool ", "pool:").replace("group ", "group:").split()
            for line in out.err.splitlines() if line[:1].isdigit()]
    assert [(r[1], r[2]) for r in rows] == [("orchestrator", "0"), ("pool:big", "1"), ("pool:small", "2-3"),
                                            ("group:speaker", "4-5"), ("group:relay", "6"), ("group:listener", "7")]
    assert rows[3][-1] == "speaker" and rows[2][-1] == "relay,listener" and "megatron" in rows[3]
