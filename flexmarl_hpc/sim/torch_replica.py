"""A torch-engine replica's memory (rollout.backend torch), the production code on fake tensors.

As sim/memory.trainer_rank does for a trainer rank, this runs the replica's own code under
sim/fake_memory.track() rather than a formula: `build.build_engine` (what runtime/run builds for
a replica rank), then a weight sync's receive of every agent the pool serves (one receive
buffer of the plan's span, weight_sync.plan_buckets at the wire dtype, as
SyncChannels.buffer holds it for the run; each bucket's `weight_sync.received` views loaded
by `TorchEngine.load_weights`, which builds the agent's model at its first load and keeps
it), then `generate` of rollout.max_batch requests per agent. The engine runs on the CPU:
every byte is host memory (a CPU pool has no device limit; its node's --mem is the check).

The generate's prompts are the agent's longest the task makes (launch/preflight.turn_prompts,
the walk preflight's length check runs: a few inputs, full-length responses), since its KV
cache and its prefill's attention scores grow with them; where the walk gives none (an
episode workflow, whose contexts grow with its dataset), as long as the model allows.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from flexmarl_hpc.config.plan import Plan
from flexmarl_hpc.config.schema import Config


@dataclass(frozen=True)
class ReplicaPhase:
    name: str
    host: int
    """Peak host bytes during the phase (all of a CPU engine's bytes)."""
    live: int
    """Host bytes still held at the phase's end."""


PHASES = ("engine start", "weight receive", "generate")


def generate_shape(cfg: Config, task, agent: str, max_seq_len: int) -> tuple[int, int, int]:
    """(turn index, prompt tokens, max_new_tokens) of `agent`'s longest generate: its turn
    whose prompt plus budget is the longest on the preflight walk; without one (episode
    workflows, a task rejecting the walk's filler), its largest budget after a prompt filling
    the rest of max_seq_len."""
    from flexmarl_hpc.launch.preflight import turn_prompts
    walked = [] if cfg.workflow.episode else \
        [(lp + turn.max_new_tokens, t, lp, turn.max_new_tokens) for t, turn, lp in turn_prompts(cfg, task)
         if turn.agent == agent]
    if walked:
        return max(walked)[1:]
    budget = cfg.workflow.max_new_tokens if cfg.workflow.episode else \
        max((t.max_new_tokens for t in cfg.workflow.turns if t.agent == agent), default=1)
    turn = next((i for i, t in enumerate(cfg.workflow.turns) if t.agent == agent), 0)
    return turn, max(max_seq_len - budget, 1), budget


def torch_replica(plan: Plan, task, p: int, wire: torch.dtype | None, agents: tuple[str, ...] = (),
                  relay: bool | None = None, prompt_tokens: int = 0) -> list[ReplicaPhase]:
    """The phases of a replica of pool `p` (PHASES). `agents`: those it receives and runs
    (default: every agent the pool serves, as a run's engine holds them all in the end).
    `relay`: whether it forwards the sync to a replica after it in the chain (None: the
    pool's first replica, a relay where the pool has more than one). `prompt_tokens` (> 0):
    the generate's prompts (default: generate_shape's)."""
    from flexmarl_hpc.ranks import build
    from flexmarl_hpc.sim.fake_memory import track
    cfg, pool = plan.cfg, plan.pools[p]
    agents = agents or tuple(pool.agents)
    relay = pool.replicas > 1 if relay is None else relay
    out: list[ReplicaPhase] = []
    with track() as c:
        def phase(name: str) -> None:
            gc.collect()
            out.append(ReplicaPhase(name, c.peak["host"], c.live["host"]))
            c.reset_peak()
        engine = build.build_engine(plan, task, "cpu", p)
        phase(PHASES[0])
        bufs = _receive(cfg, engine, agents, wire, relay)
        phase(PHASES[1])
        _generate(cfg, task, engine, agents, prompt_tokens)
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
    from flexmarl_hpc.learn.model import hf_shapes
    bucket_bytes = int(cfg.weight_sync.bucket_mb * 2**20)
    plans = {}
    for a in agents:
        layout = [(k, s, torch.float32) for k, s in hf_shapes(engine.args_of[a]).items()]
        plans[a] = weight_sync.SyncPlan((0,), (weight_sync.plan_buckets(layout, bucket_bytes, wire),))
    buf = torch.empty(max(pl.span for pl in plans.values()), dtype=torch.uint8)
    second = [torch.empty(max(pl.largest for pl in plans.values()), dtype=torch.uint8)] if relay else []
    for v, a in enumerate(agents):
        # the bytes land in `weight_sync.landing(bucket, buf)`; on fake tensors they are shapes only
        engine.load_weights(a, v + 1, (weight_sync.received(b, buf) for b in plans[a].stages[0]))
    return [buf] + second


def _generate(cfg: Config, task, engine, agents: tuple[str, ...], prompt_tokens: int) -> None:
    """rollout.max_batch requests of each agent, as one `generate` batch (the engine's largest)."""
    from flexmarl_hpc.learn.sampling import SamplingParams
    from flexmarl_hpc.rollout.base import GenRequest
    for a in agents:
        turn, lp, steps = generate_shape(cfg, task, a, engine.args_of[a].max_seq_len)
        prompt = [0] * (prompt_tokens or lp)
        reqs = [GenRequest(f"s{i}", prompt, i, steps, turn) for i in range(cfg.rollout.max_batch)]
        engine.generate(a, reqs, SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p))
