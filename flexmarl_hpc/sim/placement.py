"""Where each simulated rank sits on the fabric, and the network its weight syncs share.

Nodes are numbered as Slurm would hand out a het job's components, the orchestrator's CPU
node apart: the rollout pools in order (replica i of a pool of width g on node
offset + i g / devices_per_node), then the trainer groups (rank j of a group on node
offset + j / devices_per_node; a group's leader sends its weights). A device is named by a
global number, node x devices_per_node + slot.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from flexmarl_hpc.config.plan import Plan
from flexmarl_hpc.sim.hardware import HardwareProfile
from flexmarl_hpc.sim.network import Fabric, Flow, FlowShare, broadcast_flow, broadcast_work


def placement(plan: Plan, hw: HardwareProfile,
              colocate: list[tuple[int, int]] = ()) -> dict[int, tuple[int, int]]:
    """World rank -> (node, device) of every worker rank (a replica: its first device).
    `colocate`: (pool, group) pairs whose group sits on its pool's nodes (a colocated
    baseline: sim.baselines), one group after another there."""
    dpn, node, out, offset, layout = hw.devices_per_node, 0, {}, [], plan.layout
    for p, pool in enumerate(plan.pools):
        offset.append(node)
        for i, replica in enumerate(layout.pool_replicas(p)):
            slot = i * pool.gpus_per_replica
            out[replica + 1] = (node + slot // dpn, (node + slot // dpn) * dpn + slot % dpn)
        node += math.ceil(pool.replicas * pool.gpus_per_replica / dpn)
    home, used = dict((g, p) for p, g in colocate), {}
    for g, _ in enumerate(plan.groups):
        ranks = layout.group_ranks(g)
        first = node
        if g in home:
            first = offset[home[g]] + used.get(home[g], 0)
            used[home[g]] = used.get(home[g], 0) + math.ceil(len(ranks) / dpn)
        for j, r in enumerate(ranks):
            out[r] = (first + j // dpn, (first + j // dpn) * dpn + j % dpn)
        if g not in home:
            node += math.ceil(len(ranks) / dpn)
    return out


def fabric_of(hw: HardwareProfile) -> Fabric:
    """The profile's network at its achieved bandwidths (peak x efficiency.link)."""
    eff = hw.efficiency
    return Fabric(node_nic=hw.nic_gb_s * 1e9 * hw.nics_per_node * eff.link,
                  device_nic=hw.inter_node_bandwidth_per_device * eff.link,
                  intra=hw.intra_node_bandwidth * eff.link, nodes_per_leaf=eff.nodes_per_leaf,
                  oversubscription=eff.oversubscription, hop_latency_s=eff.collective_latency_s)


@dataclass
class SyncNetwork:
    """Weight syncs as broadcast flows over one shared fabric (`sim.transport` starts them)."""
    fabric: Fabric
    where: dict[int, tuple[int, int]]
    """World rank -> (node, device)."""
    algorithm: str = "ring"
    bucket_bytes: int = 1024 * 2**20
    bucket_latency_s: float = 5e-4
    share: FlowShare = field(init=False)

    def __post_init__(self) -> None:
        self.share = FlowShare(self.fabric, 0.0)

    def start(self, t: float, members: tuple[int, ...], nbytes: float, payload) -> Flow:
        """The broadcast from members[0] to the others, starting at `t`; `payload` comes back
        with the flow when it ends. Its fixed latency is paid before its bytes flow."""
        if self.share.t == 0.0 and not self.share.jobs:
            self.share.t = t
        links, hops = broadcast_flow(self.fabric, self.where[members[0]],
                                     [self.where[r] for r in members[1:]], self.algorithm)
        size, fixed = broadcast_work(self.fabric, nbytes, hops, math.ceil(nbytes / self.bucket_bytes),
                                     self.bucket_latency_s)
        flow = Flow(members, t + fixed, max(size, 1.0), dict(links), self.fabric.intra, payload)
        self.share.add(flow)
        return flow


def sync_network(plan: Plan, hw: HardwareProfile, colocate: list[tuple[int, int]] = ()) -> SyncNetwork:
    """The shared network of `plan`'s weight syncs on `hw` (the profile's broadcast algorithm,
    the config's buckets); `colocate` as for `placement`."""
    return SyncNetwork(fabric_of(hw), placement(plan, hw, colocate), hw.efficiency.broadcast,
                       int(plan.cfg.weight_sync.bucket_mb * 2**20),
                       hw.efficiency.bucket_latency_s)
