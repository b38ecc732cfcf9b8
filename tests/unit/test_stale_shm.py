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


def _env(kvs="63.0", restart="1"):
    return {"PMI_JOBID": kvs, "SLURM_STEP_ID": kvs.split(".")[1], "SLURM_RESTART_COUNT": restart}


def test_the_first_rank_of_an_incarnation_removes_this_steps_segments_only(tmp_path):
    ours = ["mpich_shm_59de1db0_0", "mpich_shm_59de1db0_2", "mpich_vci_59de1db0_2"]
    others = ["mpich_shm_eb421bf2_0", "mpich_shm_59de1db0", "psm2_shm.123", "flexmarl-1.0.lock"]
    for name in ours + others:
        (tmp_path / name).write_bytes(b"x")
    assert sorted(clear_stale_segments(_env(), tmp_path)) == sorted(ours)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(others + ["flexmarl-63.0.lock",
                                                                          "flexmarl-63.0-1.cleared"])
    # a later local rank of the same incarnation: a rank may be creating the new slab now
    (tmp_path / "mpich_shm_59de1db0_2").write_bytes(b"new")
    assert clear_stale_segments(_env(), tmp_path) == []
    assert (tmp_path / "mpich_shm_59de1db0_2").read_bytes() == b"new"
    # the next incarnation clears again, and keeps one marker
    assert clear_stale_segments(_env(restart="2"), tmp_path) == ["mpich_shm_59de1db0_2"]
    assert sorted(p.name for p in tmp_path.glob("flexmarl-63.0-*")) == ["flexmarl-63.0-2.cleared"]


def test_nothing_happens_outside_a_slurm_pmi_step(tmp_path):
    (tmp_path / "mpich_shm_59de1db0_0").write_bytes(b"x")
    assert clear_stale_segments({"PMI_JOBID": "63.0"}, tmp_path) == []          # mpiexec, not srun
    assert clear_stale_segments({"SLURM_STEP_ID": "0"}, tmp_path) == []          # PMIx: no PMI_JOBID
    assert clear_stale_segments(_env(kvs="../x.0"), tmp_path) == []
    assert [p.name for p in tmp_path.iterdir()] == ["mpich_shm_59de1db0_0"]
