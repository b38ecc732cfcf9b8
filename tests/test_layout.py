import pytest

from flexmarl_hpc.layout import ORCHESTRATOR, ROLLOUT, TRAINER, RankLayout, check_world


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
