"""Slurm job scripts without Slurm: scripts against golden files, config checks before
submission, the capacity check and the sinfo/sacct parsers. The real jobs are in
tests/slurm/test_slurm.py.

    pytest tests/unit/test_slurm_scripts.py
    UPDATE_GOLDEN=1 pytest tests/unit/test_slurm_scripts.py -k golden   # rewrite golden files after review
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.config.load import load_plan
from flexmarl_hpc.config.plan import resolve
from flexmarl_hpc.launch.preflight import Partition, check_capacity
from flexmarl_hpc.launch.sbatch import hetjob_script, single_script
from flexmarl_hpc.config.validate_slurm import parse_time
from flexmarl_hpc.submit import HetInfoWatcher, main as submit_main, prepare, sweep_overrides, sweep_parameters
from flexmarl_hpc.launch.preflight import parse_sinfo
from tests.conftest import ROOT

GOLDEN = ROOT / "tests/golden"
CONFIG = str(ROOT / "configs/local.yaml")
HETERO = str(ROOT / "configs/hetero_cpu.yaml")
# a 3-component site config: 1 orchestrator, 3 replicas on 3 GPU nodes, 2 groups x 2 ranks
SITE = ["run.output_dir=/scratch/flexmarl/{name}", "rollout.replicas=3", "trainer.ranks_per_group=2",
        "slurm.partition=gpu", "slurm.account=proj42", "slurm.qos=normal", "slurm.time=02:00:00",
        "slurm.mpi=pmix", "slurm.rollout={nodes: 3, gpus_per_node: 1, cpus_per_task: 8, mem: 64G}",
        "slurm.trainer={nodes: 2, gpus_per_node: 2, cpus_per_task: 8, mem: 128G, partition: gpu-large}",
        "slurm.setup=['module load cuda/12.4', 'source /opt/flexmarl/venv/bin/activate']",
        "slurm.env={NCCL_SOCKET_IFNAME: ib0, GLOO_SOCKET_IFNAME: ib0, UCX_NET_DEVICES: 'mlx5_0:1'}"]



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
    text = hetjob_script(resolve(cfg), "configs/local.yaml", SITE, python="python")
    golden("hetjob_local.sbatch", text)
    header, _, body = text.partition("\n\n")
    comps = header.split("#SBATCH hetjob")
    assert len(comps) == 3
    assert [re.search(r"--ntasks=(\d+)", c).group(1) for c in comps] == ["1", "3", "4"]
    assert "--partition=gpu-large" in comps[2]
    # a replica gets its own GPU block from Slurm; trainer ranks see every GPU of their node
    # (NCCL's peer-to-peer paths between TP ranks) and devices.py picks each one's
    assert [re.findall(r"--(?:gpus-per-task|gpus-per-node)=\d+", c) for c in comps] == [
        [], ["--gpus-per-task=1"], ["--gpus-per-node=2"]]
    assert [re.search(r"--ntasks-per-node=(\d+)", c).group(1) for c in comps] == ["1", "1", "2"]
    # every component has a --mem: the orchestrator's from slurm.mem_per_cpu (auto, no GPUs)
    assert [re.findall(r"--mem=(\S+)", c) for c in comps] == [["1000M"], ["64G"], ["128G"]]
    # one step over the 3 components, each with its --cpus-per-task (srun does not inherit it);
    # no per-task GPU binding for the trainer ranks
    assert "CMD=(python -m flexmarl_hpc.run configs/local.yaml " in body
    assert ('srun --mpi=pmix --het-group=0 --cpus-per-task=1 "${CMD[@]}" : --het-group=1 --cpus-per-task=8 '
            '"${CMD[@]}" : --het-group=2 --cpus-per-task=8 --gpu-bind=none "${CMD[@]}" &\n') in body
    # slurm.env reaches every rank, exported before srun
    assert "export NCCL_SOCKET_IFNAME=ib0\nexport GLOO_SOCKET_IFNAME=ib0\nexport UCX_NET_DEVICES=mlx5_0:1\n" in body
    assert body.index("export UCX_NET_DEVICES") < body.index("srun ")
    assert "--signal=USR1@120" in comps[0] and "--open-mode=append" in comps[0]



def test_single_allocation_script_matches_golden():
    cfg = load_config(CONFIG, SITE)
    text = single_script(resolve(cfg), "configs/local.yaml", SITE, python="python")
    golden("single_local.sbatch", text)
    assert "hetjob" not in text and "--ntasks=8" in text and "--nodes=5" in text
    assert "#SBATCH --ntasks-per-node=2\n" in text and "#SBATCH --gpus-per-node=2\n" in text
    # roles share the nodes: the tasks see the node's GPUs, flexmarl_hpc.runtime.devices splits them
    assert 'srun --mpi=pmix --ntasks=8 --cpus-per-task=8 --gpu-bind=none "${CMD[@]}" &\n' in text



TOOLS_SITE = ["run.output_dir=/scratch/flexmarl/{name}", "model.checkpoint=", "slurm.partition=gpu",
              "slurm.trainer={gpus_per_node: 3, cpus_per_task: 4, partition: gpu-large}",
              "slurm.rollout={gpus_per_node: 1, cpus_per_task: 4}", "tools.ranks=2", "tools.workers=8",
              "slurm.tools={nodes: 2, cpus_per_task: 8, partition: cpu, sbatch_options: ['--constraint=amd']}"]


def test_tools_component_script_matches_golden():
    """tools.ranks: the tool ranks are the last het component, CPU only, with their own
    partition, CPUs and options, in the same srun step; --single keeps the trainer's partition."""
    cfg = load_config(ROOT / "configs/math_team.yaml", TOOLS_SITE)
    text = hetjob_script(resolve(cfg), "configs/math_team.yaml", TOOLS_SITE, python="python")
    golden("hetjob_tools.sbatch", text)
    header, _, body = text.partition("\n\n")
    comps = header.split("#SBATCH hetjob")
    assert len(comps) == 4 and "component 3: tools" in comps[3]
    assert [re.search(r"--ntasks=(\d+)", c).group(1) for c in comps] == ["1", "1", "3", "2"]
    tools = comps[3]
    assert "--nodes=2" in tools and "--ntasks-per-node=1" in tools and "--cpus-per-task=8" in tools
    assert "--partition=cpu" in tools and "--constraint=amd" in tools and "gpus" not in tools
    assert "--mem=8000M" in tools                     # auto: 8 CPUs x slurm.mem_per_cpu
    assert ': --het-group=3 --cpus-per-task=8 "${CMD[@]}" &\n' in body
    single = single_script(resolve(cfg), "configs/math_team.yaml", TOOLS_SITE, python="python")
    assert "--ntasks=7" in single and "--partition=gpu-large" in single and "#SBATCH --constraint=amd" not in single
    assert "then trainer ranks, then tool ranks)" in single


def test_gpu_ranks_that_would_share_gpus_are_refused():
    # 3 replicas x 2 GPUs on 3 nodes of 1 GPU; 4 trainer ranks on 1 node of 2 GPUs
    with pytest.raises(ConfigError, match=r"^slurm.rollout.gpus_per_node: .* = 2 GPUs, but a node has 1"):
        hetjob_script(load_plan(CONFIG, [*SITE, "rollout.gpus_per_replica=2"]), "c.yaml")
    with pytest.raises(ConfigError, match=r"^slurm.trainer.gpus_per_node: 4 tasks on 1 node"):
        hetjob_script(load_plan(CONFIG, [*SITE, "slurm.trainer={nodes: 1, gpus_per_node: 2}"]), "c.yaml")
    # --single on 2 nodes of 4 GPUs: 4 ranks per node, replicas of 4 GPUs cannot fit
    single = [*SITE, "slurm.rollout={nodes: 1, gpus_per_node: 4}", "slurm.trainer={nodes: 1, gpus_per_node: 4}"]
    assert "--gpus-per-node=4" in single_script(load_plan(CONFIG, single), "c.yaml")
    with pytest.raises(ConfigError, match=r"^slurm.trainer.gpus_per_node: --single puts 4 ranks"):
        single_script(load_plan(CONFIG, [*single, "rollout.gpus_per_replica=4"]), "c.yaml")
    text = hetjob_script(load_plan(CONFIG, [*single, "rollout.gpus_per_replica=4", "slurm.rollout={nodes: 3, gpus_per_node: 4}"]), "c.yaml")
    assert "#SBATCH --gpus-per-task=4\n" in text                  # a replica's contiguous block
    with pytest.raises(ConfigError, match=r"^rollout.gpus_per_replica"):
        load_config(CONFIG, ["rollout.gpus_per_replica=0"])



def test_every_component_asks_for_memory():
    """--mem on every component, a size: GPU components slurm.mem_per_gpu per GPU of a node
    (16 x 48G), CPU ones slurm.mem_per_cpu per CPU they hold on a node; a set `mem` wins (0:
    the whole node); --single takes the largest set one, else the auto value of its own nodes."""
    paper = load_config(ROOT / "configs/paper_3x32b_7x14b.yaml", ["run.output_dir=/scratch/{name}"])
    comps = hetjob_script(resolve(paper), "c.yaml").partition("\n\n")[0].split("#SBATCH hetjob")
    mems = [re.findall(r"#SBATCH --mem=(\S+)", c) for c in comps]
    assert mems == [["16000M"]] + [["768G"]] * 12            # orchestrator: 16 CPUs x 1000M
    # group components: every GPU of the node, no per-task binding; pools: one block per replica
    assert [re.findall(r"--gpus-per-(?:task|node)=\d+", c) for c in comps[1:]] == [
        ["--gpus-per-task=4"], ["--gpus-per-task=1"]] + [["--gpus-per-node=16"]] * 10
    ov = ["slurm.mem_per_cpu=4G", "slurm.orchestrator={cpus_per_task: 2}", "trainer.ranks_per_group=2",
          "slurm.trainer={nodes: 1, cpus_per_task: 3, mem: 0}"]
    comps = hetjob_script(load_plan(CONFIG, ov), "c.yaml").partition("\n\n")[0].split("#SBATCH hetjob")
    assert [re.findall(r"--mem=(\S+)", c) for c in comps] == [["8G"], ["4G"], ["0"]]
    single = single_script(load_plan(CONFIG, ov), "c.yaml")
    assert re.findall(r"--mem=(\S+)", single) == ["0"]
    auto = single_script(load_plan(CONFIG, ["slurm.trainer={nodes: 1, cpus_per_task: 2}"]), "c.yaml")
    assert "#SBATCH --nodes=2 " in auto and re.findall(r"--mem=(\S+)", auto) == ["4000M"]   # 2 ranks x 2 CPUs a node
    gpus = ["slurm.mem_per_gpu=100G", "slurm.trainer={nodes: 1, gpus_per_node: 2}"]
    comps = hetjob_script(load_plan(CONFIG, gpus), "c.yaml").partition("\n\n")[0].split("#SBATCH hetjob")
    assert [re.findall(r"--mem=(\S+)", c) for c in comps] == [["1000M"], ["1000M"], ["200G"]]   # 2 GPUs x 100G


def test_slurm_env_values_are_quoted_for_the_shell():
    cfg = load_config(CONFIG, ["slurm.env={NCCL_DEBUG: WARN, X_ODD: \"a b'c\"}"])
    body = hetjob_script(resolve(cfg), "c.yaml")
    assert "export NCCL_DEBUG=WARN\nexport X_ODD='a b'\"'\"'c'\n" in body
    assert "slurm.env" not in hetjob_script(load_plan(CONFIG), "c.yaml")     # none: no section


def test_dry_run_prints_the_script_with_absolute_paths(tmp_path, capsys):
    assert submit_main([CONFIG, "--dry-run", f"run.output_dir={tmp_path}", "--no-partition-check"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash") and "srun --mpi=pmi2 --het-group=0 --cpus-per-task=1 " in out
    assert f"#SBATCH --output={tmp_path}/logs/%j.out" in out and f"run.output_dir={tmp_path}" in out
    assert not (tmp_path / "job.sbatch").exists(), "a dry run writes nothing"



def test_sbatch_options_go_to_their_component():
    cfg = load_config(CONFIG, [*SITE, "slurm.sbatch_options=['--mail-type=END']",
                               "slurm.trainer.sbatch_options=['--constraint=a100', '--exclusive']"])
    comps = hetjob_script(resolve(cfg), "c.yaml").partition("\n\n")[0].split("#SBATCH hetjob")
    assert "#SBATCH --mail-type=END\n" in comps[0] and "--mail-type" not in comps[1] + comps[2]
    assert comps[2].endswith("#SBATCH --constraint=a100\n#SBATCH --exclusive")
    assert "--constraint" not in comps[0] + comps[1]
    single = single_script(resolve(cfg), "c.yaml")
    assert all(f"#SBATCH {o}\n" in single for o in ("--mail-type=END", "--constraint=a100", "--exclusive"))
    extra = sweep_parameters(resolve(cfg))["additional_parameters"]
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
    ("slurm.trainer={mem: ''}", "slurm.trainer.mem"),
    ("slurm.mem_per_cpu=4GB", "slurm.mem_per_cpu"),
    ("slurm.mem_per_gpu=lots", "slurm.mem_per_gpu"),
    ("slurm.env={1X: a}", "slurm.env.1X"),
    ("slurm.env={A-B: a}", "slurm.env.A-B"),
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
    ("slurm.mem_per_cpu=3000M", "slurm.mem_per_cpu"),          # auto: 2 ranks x 1 CPU x 3000M > 4000 MB
    ("slurm.trainer={nodes: 2, partition: gpu, gpus_per_node: 8}", "slurm.trainer.gpus_per_node"),
])
def test_components_that_no_node_can_hold_are_refused(override, field):
    cfg = load_config(CONFIG, [override])
    with pytest.raises(ConfigError, match=f"^{re.escape(field)}"):
        check_capacity(resolve(cfg), PARTS, default="cpu")



def test_capacity_check_accepts_what_fits():
    check_capacity(load_plan(CONFIG, ["slurm.trainer={cpus_per_task: 2}"]), PARTS, default="cpu")
    check_capacity(load_plan(CONFIG, ["slurm.trainer={partition: gpu, gpus_per_node: 2, cpus_per_task: 8}"]),
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


def test_the_start_up_watchdog_follows_slurm_start_timeout():
    """The watchdog's wait is slurm.start_timeout; 0 leaves it out, the started file stays
    (rank 0 creates it either way) and srun's status is still waited for in the background."""
    cfg = load_config(ROOT / "configs/local.yaml", ["slurm.start_timeout=45"])
    text = hetjob_script(resolve(cfg), "configs/local.yaml")
    assert "$(seq 45)" in text and "after 45 s (slurm.start_timeout)" in text
    off = hetjob_script(load_plan(ROOT / "configs/local.yaml", ["slurm.start_timeout=0"]), "configs/local.yaml")
    assert "seq" not in off and "FLEXMARL_STARTED_FILE=" in off and "wait $SRUN" in off
    with pytest.raises(ConfigError, match="slurm.start_timeout"):
        load_config(ROOT / "configs/local.yaml", ["slurm.start_timeout=-1"])
