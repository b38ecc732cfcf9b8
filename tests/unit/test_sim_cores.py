"""Processor sharing of the simulated ranks' compute (sim/cores.py) and its use by the
simulated transport: exact completion times of small cases worked out by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest

from flexmarl_hpc.runtime import messages
from flexmarl_hpc.config.layout import RankLayout
from flexmarl_hpc.sim.cores import CoreShare, Job, core_rate, work_at_rate
from flexmarl_hpc.sim.transport import ConstantCost, SimTransport


def ends(share: CoreShare, t: float = math.inf) -> dict:
    return {job.key: pytest.approx(at) for at, job in share.advance(t)}


def test_three_jobs_on_two_cores_each_run_at_two_thirds():
    share = CoreShare(2, 0.0)
    for k in "abc":
        share.add(Job(k, 0.0, 1.0))
    assert share.next_end() == pytest.approx(1.5)
    assert ends(share, 10.0) == {"a": 1.5, "b": 1.5, "c": 1.5}


def test_a_start_and_an_end_re_time_the_jobs_still_running():
    """a (1 s) alone from 0; b and c (1 s each) join at 0.5: three on two cores, a's last
    0.5 s take 0.75 s (ends 1.25); b and c have done 0.5 by then and finish alone at 1.75."""
    share = CoreShare(2, 0.0)
    share.add(Job("a", 0.0, 1.0))
    share.add(Job("b", 0.5, 1.0))
    share.add(Job("c", 0.5, 1.0))
    assert ends(share) == {"a": 1.25, "b": 1.75, "c": 1.75}


def test_a_trainer_group_counts_each_of_its_ranks():
    share = CoreShare(2, 0.0)
    share.add(Job("group", 0.0, 1.0, weight=2))
    share.add(Job("replica", 0.0, 1.0))
    assert ends(share) == {"group": 1.5, "replica": 1.5}


def test_waiting_ranks_cost_nothing_while_a_core_is_idle_and_their_share_once_none_is():
    """6 ranks on 2 cores, waiting share 0.25: one computing rank keeps a whole core (the
    waiters wake up on the idle one); two computing with 4 waiting get 2 / (2 + 1) each;
    three with 3 waiting 2 / 3.75."""
    assert core_rate(1, 2, ranks=6, waiting_share=0.25) == 1.0
    assert core_rate(2, 2, ranks=6, waiting_share=0.25) == pytest.approx(2 / 3)
    assert core_rate(3, 2, ranks=6, waiting_share=0.25) == pytest.approx(2 / 3.75)
    assert core_rate(3, 2) == pytest.approx(2 / 3)                 # no share: plain sharing
    # with doorbells the workers sleep while they wait: the orchestrator alone polls
    assert core_rate(2, 2, ranks=6, waiting_share=0.25, workers_poll=False) == pytest.approx(2 / 2.25)
    assert core_rate(1, 2, ranks=6, waiting_share=0.25, workers_poll=False) == 1.0
    share = CoreShare(2, 0.0, ranks=6, waiting_share=0.25)
    share.add(Job("a", 0.0, 1.0))
    share.add(Job("b", 0.0, 1.0))
    assert ends(share) == {"a": 1.5, "b": 1.5}
    with pytest.raises(ValueError, match="waiting_share"):
        CoreShare(2, 0.0, 6, -0.1)


def test_work_at_rate_gives_back_the_work_of_jobs_run_under_the_same_sharing():
    """Jobs of known work run through CoreShare (starts and ends re-time each other, 1 to 4
    at once); their intervals, read back by work_at_rate as calibration reads a real run's,
    give each job's work. Plain durations would not (the check can fail)."""
    rng = np.random.default_rng(3)
    share = CoreShare(2, 0.0, ranks=6, waiting_share=0.3)
    jobs = [Job(i, float(s), float(w)) for i, (s, w) in
            enumerate(zip(np.sort(rng.uniform(0, 5, 12)), rng.uniform(0.2, 2.0, 12)))]
    for j in jobs:
        share.add(j)
    done = {job.key: at for at, job in share.advance(math.inf)}
    t0 = np.array([j.start for j in jobs])
    t1 = np.array([done[j.key] for j in jobs])
    work = np.array([j.work for j in jobs])
    assert work_at_rate(t0, t1, 2, 6, 0.3) == pytest.approx(work, rel=1e-9)
    assert not np.allclose(work_at_rate(t0, t1, 2, 6, 0.3, workers_poll=False), work, rtol=0.02)
    assert not np.allclose(t1 - t0, work, rtol=0.05)


def test_next_end_changes_nothing_and_the_past_is_refused():
    share = CoreShare(1, 0.0)
    share.add(Job("a", 0.0, 2.0))
    share.add(Job("b", 1.0, 1.0))
    assert share.next_end() == pytest.approx(3.0) and share.next_end() == pytest.approx(3.0)
    assert ends(share, 0.5) == {} and share.t == 0.5
    with pytest.raises(ValueError, match="in the past"):
        share.add(Job("c", 0.25, 1.0))
    assert ends(share) == {"a": 3.0, "b": 3.0}


def test_the_transport_shares_cores_among_generates_and_queues_a_busy_ranks_next_command():
    """Three replicas generating 1 s each on 2 shared cores reply at 1.5 s (the one-pass
    stretch this replaced gave 1.0, 1.0 and 1.5); a second command to a computing replica
    starts when its first ends."""
    layout = RankLayout(replicas=3, groups=1, ranks_per_group=1)

    class Echo:
        def generate(self, cmd):
            return [([1], [0.0]) for _ in cmd.requests]

    sim = SimTransport(layout, ConstantCost(generate=1.0), Echo(), t0=0.0, shared_cores=2)
    gen = lambda b: messages.Generate(b, "a", 0, [("s", [1], 0, 1, 0)])               # noqa: E731
    for rank in (1, 2, 3):
        sim.send(rank, gen(rank))
    sim.send(1, gen(9))
    got = [sim.receive() for _ in range(4)]
    times = {(src, r.batch_id): r.intervals[0][2:] for src, r in got}
    assert times[1, 1] == pytest.approx((0.0, 1.5)) and times[2, 2] == pytest.approx((0.0, 1.5))
    assert times[3, 3] == pytest.approx((0.0, 1.5))
    assert times[1, 9] == pytest.approx((1.5, 2.5))        # alone after the others: a whole core
