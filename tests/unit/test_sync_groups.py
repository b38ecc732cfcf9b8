"""The weight-sync groups a job makes at start (config/sync_groups.py, pure) and the chain a
bucket travels inside one (runtime/weight_sync.chain)."""
from __future__ import annotations

from mpi4py import MPI

from flexmarl_hpc.config.load import load_plan
from flexmarl_hpc.config.sync_groups import stage_senders
from flexmarl_hpc.runtime import sync_channels as G
from flexmarl_hpc.runtime import weight_sync as W


def test_the_paper_job_has_one_group_per_trainer_group_and_the_pool_serving_its_agent():
    """10 groups (3 x 32B TP8 PP2, 7 x 14B TP4), pools p32 and p14: 10 pairs, not 20 (a 32B
    agent is never served by p14), each with its stage senders and every replica of its pool."""
    plan = load_plan("configs/paper_3x32b_7x14b.yaml")
    layout, groups, pools = plan.layout, plan.sync_groups, plan.pools
    assert [(g.group, pools[g.pool].name) for g in groups] == [(i, "p32" if i < 3 else "p14") for i in range(10)]
    big, small = groups[0], groups[3]
    first = layout.group_leader(0)
    assert big.senders == (first, first + 16) and len(big.replicas) == 64          # PP 2: 32 ranks / 2
    assert small.senders == (layout.group_leader(3),) and len(small.replicas) == 288
    assert all(set(g.replicas) == {1 + r for r in layout.pool_replicas(g.pool)} for g in groups)
    assert sum(len(g.members) for g in groups) == 3 * (2 + 64) + 7 * (1 + 288)


def test_uniform_groups_share_the_one_pool_and_megatron_senders_are_pp_major():
    groups = load_plan("configs/local.yaml", ["rollout.replicas=3", "trainer.groups=2"]).sync_groups
    assert [(g.group, g.pool, g.members) for g in groups] == [(0, 0, (4, 1, 2, 3)), (1, 0, (5, 1, 2, 3))]
    assert stage_senders(10, 8, 2) == (10, 14) and stage_senders(10, 8, 1) == (10,)


def test_a_chain_is_the_sender_then_every_rank_of_each_target_in_order():
    """Torch groups count a vLLM replica's TP workers: its ranks are consecutive links. The
    MPI data path has one rank per member."""
    pair = G.Pair((0, 0), (10,), (1, 2, 3), MPI.COMM_SELF, first={10: 0, 1: 1, 2: 3, 3: 5},
                  count={10: 1, 1: 2, 2: 2, 3: 2})
    ch = W.SyncChannels(MPI.COMM_WORLD, "gloo")
    assert W.chain(ch, pair, 10, (3, 1)) == (0, 5, 6, 1, 2)
    ch.backend = "mpi"
    assert W.chain(ch, pair, 10, (3, 1)) == (0, 3, 1)
    ch.close()
