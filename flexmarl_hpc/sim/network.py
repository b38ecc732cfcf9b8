"""Flow-level network: max-min fair sharing of NICs and switch links, and weight broadcasts
that are flows over them.

The fabric is a two-level fat tree: each node has `node_nic` bytes/s out and in (all its
NICs), each device its own share of them (`device_nic`); `nodes_per_leaf` nodes hang off a
leaf switch whose uplink and downlink carry `nodes_per_leaf x node_nic / oversubscription`.
A transfer is a *flow* over a multiset of links (a link used twice, as a tree's inner node
sending to two children, counts twice). Rates are max-min fair (progressive filling: every
unfrozen flow's rate grows at the same pace until a link saturates, whose flows then
freeze), and `FlowShare` re-rates every flow at each start or end, so concurrent syncs
contend where their paths meet. Pure (numpy only); `sim.transport.SimTransport` uses it for
weight syncs when it is given a `Network`.

A broadcast of B bytes to R receivers, pipelined in chunks of `chunk` bytes, is one flow:
- ring (NCCL's chain for large broadcasts): the sender, then the receivers by node; every hop
  carries B; the last chunk leaves H = R hops after the first: work B + (H - 1) x chunk;
- tree (binary, by node order): H = depth = ceil(log2(R + 1)); an inner node sends B to
  each child (its links count twice): work B + (H - 1) x chunk.
A hop inside a node rides HCCS/NVLink (no NIC link; the flow is capped by the device's
intra-node bandwidth instead). The fixed part, `buckets x bucket_latency + H x hop_latency`,
is paid before the bytes flow.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Hashable, Literal, Mapping, Sequence

import numpy as np

EPS = 1e-9


def maxmin_rates(flows: Sequence[Mapping[Hashable, int]], capacity: Mapping[Hashable, float],
                 caps: Sequence[float] | None = None) -> np.ndarray:
    """Max-min fair rates (bytes/s) of `flows`, each a {link: multiplicity} over links of
    `capacity` bytes/s, each flow at most its `caps` (inf by default). Progressive filling.
    Plain floats, not numpy: the arrays hold a handful of flows, where numpy's per-element
    indexing cost 8% of `simulate paper` (the same operations in the same order: equal
    rates, bit for bit)."""
    n = len(flows)
    rate = [0.0] * n
    cap = [math.inf] * n if caps is None else [float(c) for c in caps]
    frozen = [False] * n
    users: dict[Hashable, list[tuple[int, int]]] = {}
    for i, f in enumerate(flows):
        for link, m in f.items():
            users.setdefault(link, []).append((i, m))
    left = {link: float(capacity[link]) for link in users}
    while not all(frozen):
        # the smallest step that saturates a link or brings a flow to its cap
        step, tight = math.inf, []
        live = [not x for x in frozen]
        load = {link: sum(m for i, m in us if live[i]) for link, us in users.items()}
        for link, room in left.items():
            k = load[link]
            if k:
                s = room / k
                if s < step * (1 - EPS):
                    step, tight = s, [link]
                elif s <= step * (1 + EPS):
                    tight.append(link)
        own = min((cap[i] - rate[i] for i in range(n) if live[i]), default=math.inf)
        if own < step * (1 - EPS):
            step, tight = own, []
        if step == math.inf:
            raise ValueError("a flow crosses no link and has no cap: its rate is unbounded")
        for i in range(n):
            if live[i]:
                rate[i] += step
        for link in left:
            left[link] -= step * load[link]
        for i in range(n):
            if live[i] and cap[i] != math.inf and cap[i] - rate[i] <= EPS * max(cap[i], 1.0):
                frozen[i] = True
        for link in tight:
            for i, _ in users[link]:
                frozen[i] = True
    return np.array(rate)


@dataclass(frozen=True)
class Fabric:
    """The network's capacities, bytes/s (achieved: the profile's peak x `efficiency.link`)."""

    node_nic: float
    """All NICs of a node, one direction."""
    device_nic: float
    """One device's share of its node's NICs, one direction."""
    intra: float
    """One device's HCCS/NVLink bandwidth, one direction."""
    nodes_per_leaf: int = 16
    """Nodes under one leaf switch."""
    oversubscription: float = 1.0
    """Leaf downlink : uplink bandwidth (1: non-blocking fat tree)."""
    chunk_bytes: int = 4 * 2**20
    """Pipelining unit of a broadcast (NCCL_BUFFSIZE's default, 4 MiB)."""
    hop_latency_s: float = 2e-5
    """Fixed cost of a chunk's hop (the collective's launch and handshake)."""

    def capacity(self, link: tuple) -> float:
        kind = link[0]
        if kind in ("tx", "rx"):
            return self.node_nic
        if kind in ("up", "down"):
            return self.nodes_per_leaf * self.node_nic / self.oversubscription
        if kind in ("dtx", "drx"):
            return self.device_nic
        raise ValueError(f"unknown link {link!r}")


def hop_links(fabric: Fabric, a: tuple[int, int], b: tuple[int, int]) -> list[tuple]:
    """Links a hop from device a = (node, rank) to b crosses (none inside a node)."""
    (na, ra), (nb, rb) = a, b
    if na == nb:
        return []
    out = [("dtx", ra), ("tx", na), ("rx", nb), ("drx", rb)]
    la, lb = na // fabric.nodes_per_leaf, nb // fabric.nodes_per_leaf
    if la != lb:
        out += [("up", la), ("down", lb)]
    return out


def broadcast_flow(fabric: Fabric, sender: tuple[int, int], receivers: Sequence[tuple[int, int]],
                   algorithm: Literal["ring", "tree"] = "ring") -> tuple[Counter, int]:
    """The links (with multiplicity) of a broadcast from `sender` to `receivers`, devices as
    (node, rank), and its hop count H (ring: the receivers; tree: its depth)."""
    order = [sender] + sorted(receivers)
    links: Counter = Counter()
    if algorithm == "ring":
        for a, b in zip(order, order[1:]):
            links.update(hop_links(fabric, a, b))
        return links, len(receivers)
    if algorithm != "tree":
        raise ValueError(f"broadcast algorithm: expected ring or tree, got {algorithm!r}")
    for child in range(1, len(order)):
        links.update(hop_links(fabric, order[(child - 1) // 2], order[child]))
    return links, math.ceil(math.log2(len(order))) if receivers else 0


def broadcast_work(fabric: Fabric, nbytes: float, hops: int, buckets: int,
                   bucket_latency_s: float) -> tuple[float, float]:
    """(bytes that flow, fixed seconds) of a pipelined broadcast over `hops` hops."""
    if nbytes <= 0 or hops <= 0:
        return 0.0, 0.0
    chunk = min(fabric.chunk_bytes, nbytes)
    return nbytes + (hops - 1) * chunk, buckets * bucket_latency_s + hops * fabric.hop_latency_s


@dataclass(eq=False)
class Flow:
    """One transfer in flight."""
    key: Any
    start: float
    """When its bytes start to flow."""
    size: float
    """Bytes to move."""
    links: Mapping[Hashable, int]
    cap: float = math.inf
    """Its own rate limit (a hop inside a node: the device's intra-node bandwidth)."""
    payload: Any = None
    done: float = 0.0


@dataclass
class FlowShare:
    """Flows sharing `fabric` from time `t` on, max-min fair, re-rated at every start and end
    (the network twin of sim.cores.CoreShare: add, advance, next_end)."""
    fabric: Fabric
    t: float
    jobs: list[Flow] = field(default_factory=list)

    _cache: tuple = ((), {})
    """(the live flows, their rates): rates change only when that set does."""

    def add(self, flow: Flow) -> None:
        flow.start = max(flow.start, self.t)
        self.jobs.append(flow)

    def rates(self) -> dict[Flow, float]:
        live = tuple(f for f in self.jobs if f.start <= self.t)
        if not live:
            return {}
        if live != self._cache[0]:             # identity: a Flow compares as itself
            cap = {l: self.fabric.capacity(l) for f in live for l in f.links}
            r = maxmin_rates([f.links for f in live], cap, [f.cap for f in live])
            self._cache = (live, dict(zip(live, r)))
        return self._cache[1]

    def _next(self, rates: dict[Flow, float]) -> tuple[float, Flow | None]:
        end, first = math.inf, None
        for f, r in rates.items():
            te = self.t + max(f.size - f.done, 0.0) / r if r > 0 else math.inf
            if te < end:
                end, first = te, f
        start = min((f.start for f in self.jobs if f.start > self.t), default=math.inf)
        return (start, None) if start < end else (end, first)

    def _go(self, t: float, rates: dict[Flow, float]) -> None:
        for f, r in rates.items():
            f.done += (t - self.t) * r
        self.t = t

    def advance(self, t: float) -> list[tuple[float, Flow]]:
        """Move the clock to `t`; the flows that complete by then, with their times, in order."""
        out = []
        while self.jobs:
            rates = self.rates()
            te, flow = self._next(rates)
            if te > t:
                break
            self._go(te, rates)
            if flow is not None:
                self.jobs.remove(flow)
                out.append((te, flow))
        if t > self.t:
            self._go(t, self.rates())
        return out

    def next_end(self) -> float:
        """When the next flow completes if nothing is added meanwhile (inf: none left)."""
        saved = (self.t, [(f, f.done) for f in self.jobs])
        try:
            while self.jobs:
                rates = self.rates()
                te, flow = self._next(rates)
                if flow is not None or te == math.inf:
                    return te
                self._go(te, rates)
            return math.inf
        finally:
            self.t = saved[0]
            for f, done in saved[1]:
                f.done = done
