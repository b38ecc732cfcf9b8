import pytest

from flexmarl_hpc.config.layout import ORCHESTRATOR, ROLLOUT, TOOLS, TRAINER, RankLayout, check_world


def test_rank_roles_in_component_order():
    lay = RankLayout(replicas=3, groups=2, ranks_per_group=2)
    assert lay.world_size == 8
    assert lay.component_sizes == (1, 3, 4)
    assert [lay.role_of(r) for r in range(8)] == [
        (ORCHESTRATOR, 0), (ROLLOUT, 0), (ROLLOUT, 1), (ROLLOUT, 2),
        (TRAINER, 0), (TRAINER, 0), (TRAINER, 1), (TRAINER, 1)]
    assert lay.group_ranks(1) == [6, 7] and lay.group_leader(0) == 4
    assert lay.replica_ranks == [1, 2, 3]
    assert sorted({lay.split_color(r) for r in range(8)}) == [0, 1, 2, 3]


def test_tool_ranks_come_last_and_every_other_rank_keeps_its_number():
    """tools.ranks: one het component after the trainers, so the rank of every replica and
    trainer rank, the trainer colors and the leaders stay what they are without it."""
    base, lay = RankLayout(3, 2, 2), RankLayout(3, 2, 2, tool_ranks=2)
    assert lay.world_size == 10 and lay.workers == base.workers == 7
    assert lay.component_sizes == (1, 3, 4, 2)
    assert [lay.role_of(r) for r in range(8)] == [base.role_of(r) for r in range(8)]
    assert [lay.role_of(r) for r in (8, 9)] == [(TOOLS, 0), (TOOLS, 1)] and lay.tool_rank_list == [8, 9]
    assert [lay.split_color(r) for r in range(10)] == [base.split_color(r) for r in range(8)] + [4, 4]
    assert RankLayout.of([1, 2], [2, 1], tool_ranks=1).role_of(7) == (TOOLS, 0)
    with pytest.raises(ValueError, match=r"needs 10 .* \+ 2 tools.ranks"):
        check_world(lay, 8)
    from flexmarl_hpc.orchestrator.failures import who
    assert who(lay, 9) == "tool rank 1" and who(lay, 7).startswith("trainer group 1")


def test_layout_errors():
    with pytest.raises(ValueError):
        RankLayout(0, 1, 1)
    lay = RankLayout(1, 2, 1)
    with pytest.raises(ValueError, match="needs 4"):
        check_world(lay, 3)
    with pytest.raises(ValueError):
        lay.role_of(4)
    with pytest.raises(ValueError):
        lay.group_ranks(2)


# ---------------------------------------------------------------------------------------
# device binding (flexmarl_hpc.runtime.devices): each replica and trainer rank on GPUs of its own
# ---------------------------------------------------------------------------------------
from flexmarl_hpc.runtime.devices import CPU, Binding, choose_device, node_peers, role_widths, visible_gpus  # noqa: E402


def _node_bindings(layout, ranks, envs, gpus_per_replica=1):
    """Bindings of the ranks of one node, each from its own task environment."""
    peers = [(r, layout.role_of(r)[0]) for r in ranks]
    return {r: choose_device(r, peers, role_widths(layout, gpus_per_replica), visible_gpus(env))
            for r, env in zip(ranks, envs)}


def _physical(b: Binding) -> set[str]:
    return set(b.gpus)


def _assert_distinct(bindings):
    owned = [g for b in bindings.values() for g in b.gpus]
    assert len(owned) == len(set(owned)), f"GPUs shared: {bindings}"


def test_visible_gpus_from_the_task_environment():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2,3", "SLURM_STEP_GPUS": "4"}) == ["0", "1", "2", "3"]
    assert visible_gpus({"SLURM_STEP_GPUS": "2,3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"SLURM_LOCALID": "3"}) is None          # not told: ask CUDA


def test_het_job_every_replica_and_trainer_rank_gets_its_own_gpu():
    """Het job, 8 replicas on 2 nodes x 4 GPUs, 2 groups x 4 trainer ranks on 2 nodes x 4 GPUs;
    Slurm either shows each task every GPU of its node (--gpus-per-node) or binds one per
    task (--gpus-per-task=1: CUDA_VISIBLE_DEVICES is the task's own GPU)."""
    lay = RankLayout(replicas=8, groups=2, ranks_per_group=4)
    nodes = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
    for bound in (False, True):
        for ranks in nodes:
            envs = [{"CUDA_VISIBLE_DEVICES": str(i) if bound else "0,1,2,3", "SLURM_LOCALID": str(i)}
                    for i in range(4)]
            got = _node_bindings(lay, ranks, envs)
            _assert_distinct(got)
            assert sorted(g for b in got.values() for g in b.gpus) == ["0", "1", "2", "3"]
            for r, b in got.items():
                if lay.role_of(r)[0] == ROLLOUT:       # vLLM sees only its GPU, as cuda:0
                    assert b.device == "cuda:0" and b.visible == ",".join(b.gpus)
                else:                                  # trainers keep every GPU visible (NCCL P2P)
                    assert b.visible is None and b.device == ("cuda:0" if bound else f"cuda:{b.gpus[0]}")
    orch = _node_bindings(lay, [0], [{"CUDA_VISIBLE_DEVICES": "0"}])
    assert orch == {0: CPU}


def test_trainer_ranks_see_their_node_and_take_their_local_gpu():
    """The het job's trainer components (--gpus-per-node=16, srun --gpu-bind=none): each of a
    node's 16 ranks (2 TP-8 groups' worth) sees all 16 GPUs, keeps them visible (NCCL's
    peer-to-peer paths to its TP peers) and sets cuda:<local rank>, which is SLURM_LOCALID
    here. A replica component sharing the node (Slurm may place two components together;
    their SLURM_LOCALIDs both start at 0) does not make two ranks take one GPU."""
    lay = RankLayout(replicas=4, groups=1, ranks_per_group=32)
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(16)))}
    ranks = list(range(5, 21))                                   # trainer ranks 0-15 of the group
    got = _node_bindings(lay, ranks, [env] * 16)
    assert [got[r].device for r in ranks] == [f"cuda:{i}" for i in range(16)]
    assert all(got[r].visible is None and got[r].gpus == (str(i),) for i, r in enumerate(ranks))
    shared = _node_bindings(lay, [1, 2, 5, 6], [env] * 4, gpus_per_replica=2)   # 2 replicas + 2 trainer ranks
    _assert_distinct(shared)
    assert [shared[r].gpus for r in (1, 2, 5, 6)] == [("0", "1"), ("2", "3"), ("4",), ("5",)]
    assert shared[5].device == "cuda:4" and shared[1].visible == "0,1"


def test_single_job_does_not_count_the_orchestrator_or_other_roles():
    """--single: 1 orchestrator + 2 replicas + 2 groups x 2 trainer ranks on 2 nodes of 4 GPUs,
    4 tasks per node. Before, vLLM put both replicas on GPU 0 and a trainer took GPU
    SLURM_LOCALID (3, counting the orchestrator and the replicas); by role, the node's GPU
    ranks take consecutive GPUs and the orchestrator none."""
    lay = RankLayout(replicas=2, groups=2, ranks_per_group=2)
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    node0 = _node_bindings(lay, [0, 1, 2, 3], [env] * 4)
    node1 = _node_bindings(lay, [4, 5, 6], [env] * 3)
    assert node0[0] == CPU
    assert [node0[r].gpus for r in (1, 2, 3)] == [("0",), ("1",), ("2",)]
    assert [node1[r].device for r in (4, 5, 6)] == ["cuda:0", "cuda:1", "cuda:2"]
    assert node0[1].visible == "0" and node0[2].visible == "1" and node0[3].device == "cuda:2"


def test_replicas_with_several_gpus_get_contiguous_blocks():
    lay = RankLayout(replicas=2, groups=1, ranks_per_group=4)
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7,0,1,2,3"}          # physical ids as Slurm lists them
    got = _node_bindings(lay, [0, 1, 2], [env] * 3, gpus_per_replica=4)
    assert got[1] == Binding("cuda:0", "4,5,6,7", ("4", "5", "6", "7"))
    assert got[2] == Binding("cuda:0", "0,1,2,3", ("0", "1", "2", "3"))
    bound = _node_bindings(lay, [1, 2], [{"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}],
                           gpus_per_replica=4)                # --gpus-per-task=4: Slurm's blocks
    assert bound[1].visible == "0,1,2,3" and bound[2].visible == "4,5,6,7"


def test_too_few_gpus_is_an_error_not_a_shared_gpu():
    lay = RankLayout(replicas=3, groups=1, ranks_per_group=1)
    with pytest.raises(ValueError, match="4 GPUs in all, but this rank sees 2"):
        _node_bindings(lay, [1, 2, 3, 4], [{"CUDA_VISIBLE_DEVICES": "0,1"}] * 4)


def test_cpu_nodes_and_the_mpi_node_split():
    lay = RankLayout(replicas=1, groups=1, ranks_per_group=1)
    assert _node_bindings(lay, [0, 1, 2], [{"CUDA_VISIBLE_DEVICES": ""}] * 3) == {0: CPU, 1: CPU, 2: CPU}
    from mpi4py import MPI
    assert node_peers(MPI.COMM_SELF, lay) == [(0, ORCHESTRATOR)]
