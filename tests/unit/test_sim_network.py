"""sim.network: max-min fair flow rates, broadcasts as flows, contention over time; every
expected figure is computed by hand in the test's docstring or comment."""
from __future__ import annotations

import math

import pytest

from flexmarl_hpc.sim.network import (Fabric, Flow, FlowShare, broadcast_flow, broadcast_work, hop_links,
                                      maxmin_rates)

FAB = Fabric(node_nic=400.0, device_nic=25.0, intra=196.0, nodes_per_leaf=2, oversubscription=4.0,
             chunk_bytes=4, hop_latency_s=0.01)


def test_two_flows_on_one_link_halve_it():
    assert list(maxmin_rates([{"a": 1}, {"a": 1}], {"a": 10.0})) == [5.0, 5.0]


def test_maxmin_gives_what_a_bottlenecked_flow_leaves_to_the_others():
    """f1 on A (10), f2 on A and B (4), f3 on B: B saturates first at 2 each; f1 then takes
    the 8 left on A (an equal split, 5/5/2, would waste 3 of A)."""
    r = maxmin_rates([{"A": 1}, {"A": 1, "B": 1}, {"B": 1}], {"A": 10.0, "B": 4.0})
    assert r == pytest.approx([8.0, 2.0, 2.0])


def test_a_link_used_twice_counts_twice_and_caps_bind():
    assert maxmin_rates([{"a": 2}], {"a": 10.0}) == pytest.approx([5.0])
    assert maxmin_rates([{"a": 1}, {"a": 1}], {"a": 10.0}, [3.0, math.inf]) == pytest.approx([3.0, 7.0])
    with pytest.raises(ValueError, match="unbounded"):
        maxmin_rates([{}], {})


def test_leaf_links_carry_the_oversubscribed_share():
    # 2 nodes per leaf x 400 / 4 = 200 each way
    assert FAB.capacity(("up", 0)) == 200.0 and FAB.capacity(("tx", 3)) == 400.0
    assert hop_links(FAB, (0, 1), (0, 2)) == []                      # inside a node: HCCS
    assert hop_links(FAB, (0, 1), (1, 2)) == [("dtx", 1), ("tx", 0), ("rx", 1), ("drx", 2)]
    assert ("up", 0) in hop_links(FAB, (0, 1), (2, 2)) and ("down", 1) in hop_links(FAB, (0, 1), (2, 2))


def test_a_ring_crosses_each_node_boundary_once_and_a_tree_sends_twice_from_inner_nodes():
    receivers = [(1, 11), (0, 2), (1, 12), (2, 21)]
    links, hops = broadcast_flow(FAB, (0, 1), receivers, "ring")
    # ring by node: (0,1) -> (0,2) -> (1,11) -> (1,12) -> (2,21): two NIC hops, 4 hops in all
    assert hops == 4 and links[("tx", 0)] == 1 and links[("tx", 1)] == 1 and links[("rx", 2)] == 1
    tlinks, depth = broadcast_flow(FAB, (0, 1), receivers, "tree")
    # order (0,1),(0,2),(1,11),(1,12),(2,21): children of (0,1) are (0,2) and (1,11); of (0,2)
    # are (1,12) and (2,21): node 0 sends 3 times over its NICs; depth ceil(log2 5) = 3
    assert depth == 3 and tlinks[("tx", 0)] == 3 and tlinks[("dtx", 2)] == 2
    with pytest.raises(ValueError, match="ring or tree"):
        broadcast_flow(FAB, (0, 1), receivers, "star")


def test_broadcast_work_adds_the_pipeline_fill_and_fixed_latency():
    # 100 bytes in chunks of 4 over 3 hops: 100 + 2 x 4 bytes; 2 buckets x 0.5 + 3 x 0.01 s
    assert broadcast_work(FAB, 100, 3, 2, 0.5) == pytest.approx((108.0, 1.03))
    assert broadcast_work(FAB, 0, 3, 1, 0.5) == (0.0, 0.0)


def test_flows_are_rerated_when_one_ends_or_starts():
    """Link of 10: a (10 B) and b (20 B) from t=0 share 5/s; a ends at 2 with b at 10 B
    done; b alone at 10/s ends at 3. c (10 B) starting at 3 on an idle link ends at 4."""
    share = FlowShare(Fabric(10.0, 10.0, 10.0), 0.0)
    a, b = Flow("a", 0.0, 10.0, {("tx", 0): 1}), Flow("b", 0.0, 20.0, {("tx", 0): 1})
    share.add(a)
    share.add(b)
    assert share.next_end() == pytest.approx(2.0)
    done = share.advance(2.5)
    assert [(t, f.key) for t, f in done] == [(pytest.approx(2.0), "a")]
    share.add(Flow("c", 3.0, 10.0, {("tx", 1): 1}))
    out = share.advance(10.0)
    assert [(round(t, 6), f.key) for t, f in out] == [(3.0, "b"), (4.0, "c")]


def test_next_end_sees_a_later_start_slow_the_running_flow():
    """a (10 B) alone at 10/s from 0; b (10 B) joins at 0.5: a has 5 B left at 5/s, ends at 1.5."""
    share = FlowShare(Fabric(10.0, 10.0, 10.0), 0.0)
    share.add(Flow("a", 0.0, 10.0, {("tx", 0): 1}))
    share.add(Flow("b", 0.5, 10.0, {("tx", 0): 1}))
    assert share.next_end() == pytest.approx(1.5)
    assert share.jobs[0].done == 0.0          # next_end leaves the state as it was
