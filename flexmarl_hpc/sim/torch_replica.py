"""A torch-engine replica's memory (rollout.backend torch), the production code on fake tensors.

As sim/memory.trainer_rank does for a trainer rank, this runs the replica's own code under
sim/memtrack.track() rather than a formula: `build.build_engine` (what runtime/run builds for
a replica rank), then a weight sync's receive of every agent the pool serves (one receive
buffer of the plan's span, weight_sync.plan_buckets at the wire dtype, as
SyncChannels.buffer holds it for the run; each bucket's `weight_sync.received` views loaded
by `TorchEngine.load_weights`, which builds the agent's model at its first load and keeps
it), then `generate` of rollout.max_batch requests per agent. The engine runs on the CPU:
every byte is host memory (a CPU pool has no device limit; its node's --mem is the check).

The generate's prompts are as long as the model allows (max_seq_len - max_new_tokens, its
turns' largest budget): the task's prompt lengths are not in the config, and the KV cache
and the prefill's attention scores grow with them, so this is the bound the check needs.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from flexmarl_hpc.config.schema import Config


@dataclass(frozen=True)
class ReplicaPhase:
    name: str
    host: int
    """Peak host bytes during the phase (all of a CPU engine's bytes)."""
    live: int
    """Host bytes still held at the phase's end."""


PHASES = ("engine start", "weight receive", "generate")


def longest_turn(cfg: Config, agent: str) -> tuple[int, int]:
    """(turn index, max_new_tokens) of `agent`'s turn with the largest response budget."""
    turns = [(t.max_new_tokens, i) for i, t in enumerate(cfg.workflow.turns) if t.agent == agent]
    steps, turn = max(turns, default=(1, 0))
    return turn, steps


def torch_replica(cfg: Config, task, p: int, wire: torch.dtype | None, agents: tuple[str, ...] = (),
                  relay: bool | None = None) -> list[ReplicaPhase]:
    """The phases of a replica of pool `p` (PHASES). `agents`: those it receives and runs
    (default: every agent the pool serves, as a run's engine holds them all in the end).
    `relay`: whether it forwards the sync to a replica after it in the chain (None: the
    pool's first replica, a relay where the pool has more than one)."""
    from flexmarl_hpc.config.resources import rollout_pools
    from flexmarl_hpc.runtime import build
    from flexmarl_hpc.sim.memtrack import track
    pool = rollout_pools(cfg)[p]
    agents = agents or tuple(pool.agents)
    relay = pool.replicas > 1 if relay is None else relay
    out: list[ReplicaPhase] = []
    with track() as c:
        def phase(name: str) -> None:
            gc.collect()
            out.append(ReplicaPhase(name, c.peak["host"], c.live["host"]))
            c.reset_peak()
        engine = build.build_engine(cfg, task, "cpu", p)
        phase(PHASES[0])
        bufs = _receive(cfg, engine, agents, wire, relay)
        phase(PHASES[1])
        _generate(cfg, engine, agents)
        phase(PHASES[2])
        del bufs
    return out


def _receive(cfg: Config, engine, agents: tuple[str, ...], wire: torch.dtype | None,
             relay: bool) -> list[torch.Tensor]:
    """Each agent's sync into the engine, bucket by bucket through one receive buffer (the
    largest span of the agents' plans: SyncChannels.buffer grows it and frees the old one
    first) and, on a relay, a second of the largest bucket (weight_sync._receive_stage lands
    buckets in turn in both, receiving the next while forwarding the last). The run keeps
    them for the next sync: returned, to stay alive."""
    from flexmarl_hpc.runtime import weight_sync
    from flexmarl_hpc.sim.memory import _hf_shapes
    bucket_bytes = int(cfg.weight_sync.bucket_mb * 2**20)
    plans = {}
    for a in agents:
        layout = [(k, s, torch.float32) for k, s in _hf_shapes(engine.args_of[a]).items()]
        plans[a] = weight_sync.Plan((0,), (weight_sync.plan_buckets(layout, bucket_bytes, wire),))
    buf = torch.empty(max(pl.span for pl in plans.values()), dtype=torch.uint8)
    second = [torch.empty(max(pl.largest for pl in plans.values()), dtype=torch.uint8)] if relay else []
    for v, a in enumerate(agents):
        # the bytes land in `weight_sync.landing(bucket, buf)`; on fake tensors they are shapes only
        engine.load_weights(a, v + 1, (weight_sync.received(b, buf) for b in plans[a].stages[0]))
    return [buf] + second


def _generate(cfg: Config, engine, agents: tuple[str, ...]) -> None:
    """rollout.max_batch requests of each agent, as one `generate` batch (the engine's largest)."""
    from flexmarl_hpc.learn.sampling import SamplingParams
    from flexmarl_hpc.rollout.base import GenRequest
    for a in agents:
        turn, steps = longest_turn(cfg, a)
        prompt = [0] * max(engine.args_of[a].max_seq_len - steps, 1)
        reqs = [GenRequest(f"s{i}", prompt, i, steps, turn) for i in range(cfg.rollout.max_batch)]
        engine.generate(a, reqs, SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p))
