"""runtime/stale_shm.py: the segments of a killed incarnation of this Slurm step are removed
once per incarnation and node, before MPI_Init, and nothing else is touched.

    pytest tests/unit/test_stale_shm.py
"""
from __future__ import annotations

from flexmarl_hpc.runtime.stale_shm import clear_stale_segments, fnv1a32, segment_prefixes


def test_the_world_id_is_mpichs_fnv1a_of_the_kvs_name():
    # names seen in /dev/shm here after killed Slurm steps 63.0 and 1.0 (docs/LOG.md, 2026-11-29)
    assert f"{fnv1a32('63.0'):x}" == "59de1db0"
    assert f"{fnv1a32('1.0'):x}" == "eb421bf2"
    assert segment_prefixes("63.0") == ("mpich_shm_59de1db0_", "mpich_vci_59de1db0_")


def _env(kvs="63.0", restart="1", port="41533"):
    return {"PMI_JOBID": kvs, "SLURM_STEP_ID": kvs.split(".")[1], "SLURM_RESTART_COUNT": restart,
            "SLURM_SRUN_COMM_HOST": "10.0.0.7", "SLURM_SRUN_COMM_PORT": port}


def test_the_first_rank_of_an_incarnation_removes_this_steps_segments_only(tmp_path):
    ours = ["mpich_shm_59de1db0_0", "mpich_shm_59de1db0_2", "mpich_vci_59de1db0_2"]
    others = ["mpich_shm_eb421bf2_0", "mpich_shm_59de1db0", "psm2_shm.123", "flexmarl-1.0.lock"]
    for name in ours + others:
        (tmp_path / name).write_bytes(b"x")
    assert sorted(clear_stale_segments(_env(), tmp_path)) == sorted(ours)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(others + ["flexmarl-63.0.lock"])
    # a later local rank of the same incarnation: a rank may be creating the new slab now
    (tmp_path / "mpich_shm_59de1db0_2").write_bytes(b"new")
    assert clear_stale_segments(_env(), tmp_path) == []
    assert (tmp_path / "mpich_shm_59de1db0_2").read_bytes() == b"new"
    # the next incarnation clears again, and the lock file holds only the latest
    assert clear_stale_segments(_env(restart="2"), tmp_path) == ["mpich_shm_59de1db0_2"]
    assert (tmp_path / "flexmarl-63.0.lock").read_text() == "2:10.0.0.7:41533"


def test_a_job_id_that_comes_round_again_still_clears(tmp_path):
    # CI 2026-11-29: the local cluster starts with fresh state, so job 55 of this run met the
    # marker job 55 of an earlier run left for the same restart count, and removed nothing
    assert clear_stale_segments(_env(kvs="55.0", port="40001"), tmp_path) == []
    (tmp_path / "mpich_shm_477f8ec9_0").write_bytes(b"killed incarnation")
    assert clear_stale_segments(_env(kvs="55.0", port="35719"), tmp_path) == ["mpich_shm_477f8ec9_0"]


def test_the_first_versions_markers_go_and_do_not_stop_a_clean_up(tmp_path):
    (tmp_path / "flexmarl-63.0-1.cleared").touch()
    (tmp_path / "flexmarl-63.0.lock").touch()                # the first version left it empty
    (tmp_path / "mpich_shm_59de1db0_0").write_bytes(b"x")
    assert clear_stale_segments(_env(), tmp_path) == ["mpich_shm_59de1db0_0"]
    assert [p.name for p in tmp_path.iterdir()] == ["flexmarl-63.0.lock"]


def test_nothing_happens_outside_a_slurm_pmi_step(tmp_path):
    (tmp_path / "mpich_shm_59de1db0_0").write_bytes(b"x")
    assert clear_stale_segments({"PMI_JOBID": "63.0"}, tmp_path) == []          # mpiexec, not srun
    assert clear_stale_segments({"SLURM_STEP_ID": "0"}, tmp_path) == []          # PMIx: no PMI_JOBID
    assert clear_stale_segments(_env(kvs="../x.0"), tmp_path) == []
    assert [p.name for p in tmp_path.iterdir()] == ["mpich_shm_59de1db0_0"]


def test_the_components_of_a_het_step_clear_once_per_start(tmp_path):
    # CI 2026-11-29: srun listens on one port per het component, so with the srun's address as
    # the incarnation each component's first rank cleared, removing the slab another component
    # had just made, and hetero_cpu's six-component job hung in MPI_Init
    start = {"FLEXMARL_INCARNATION": "55.0.1764423728000000001"}
    (tmp_path / "mpich_shm_477f8ec9_0").write_bytes(b"killed start")
    assert clear_stale_segments({**_env(kvs="55.0", port="42699"), **start}, tmp_path) == ["mpich_shm_477f8ec9_0"]
    (tmp_path / "mpich_shm_477f8ec9_0").write_bytes(b"component 0, this start")
    assert clear_stale_segments({**_env(kvs="55.0", port="45843"), **start}, tmp_path) == []
    assert (tmp_path / "mpich_shm_477f8ec9_0").read_bytes() == b"component 0, this start"
    # the next start of the same job (same restart count after a reset cluster) clears again
    later = {"FLEXMARL_INCARNATION": "55.0.1764423999000000002"}
    assert clear_stale_segments({**_env(kvs="55.0", port="42699"), **later}, tmp_path) == ["mpich_shm_477f8ec9_0"]
