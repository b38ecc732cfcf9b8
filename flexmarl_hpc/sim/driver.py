"""One simulated run: the real Orchestrator, scheduler, Experience, workflow and rewards over
SimTransport, priced by sim.costs.CostModel, with one of two kinds of workers:

- "synthetic" (large models): no model runs; described below;
- "real" (small models): sim.inprocess.InProcessWorkers, the real engine and trainers in this
  process, so the responses, their lengths, the rewards and the trained weights are those of
  an MPI run of the config (tests/e2e/test_sim_equals_mpi.py); only the clock is modelled, from
  the real lengths (use it with a calibrated profile: `simulate --calibrate ... --workers real`).

Synthetic workers:

Responses carry the task's real tokens (at most the turn's max_new_tokens, so the workflow's
reward runs on real text: for a random synthetic policy it is a random reward), while their
*cost* is that of a modelled response: a length drawn from the long-tailed
`LengthDistribution` (max 8192 tokens) after a declared prompt of `prompt_tokens`. Training
compute is skipped; its time is that of micro-batches of modelled tokens (each row the
prompt plus the distribution's mean length: a micro-batch of 16 averages the tail).

Clock: the store and the orchestrator are built with the transport's simulated clock
(`SimTransport.clock`, a flexmarl_hpc.clock.SimulatedClock), so everything they timestamp (its
busy intervals schedule/handle/store/log, /metrics t, /steps, the store's elapsed time) and
the command deadlines are simulated time: the HDF5 file is one coherent simulated timeline.
The orchestrator's own work costs the profile's modelled seconds (per reply, per optimizer
step, per message byte), or its real compute when `charge_orchestrator` adds it to the clock
(the capacity measurement does). Weight syncs are flows on the profile's fabric
(sim.placement), except on shared cores (one machine). The reward watchdog
(runtime.timing.Watchdog) stays on the real clock: a hung reward function hangs this process.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Mapping
from pathlib import Path

import h5py
import numpy as np
import yaml

from flexmarl_hpc.config.schema import Config, ConfigError
from flexmarl_hpc.config.load import to_dict
from flexmarl_hpc.config.layout import ROLLOUT
from flexmarl_hpc.config.plan import Plan
from flexmarl_hpc.sim.costs import (AgentLayout, CostModel, LengthDistribution, ModelShape, recompute_fraction,
                                    shape_from_model_args)
from flexmarl_hpc.sim.hardware import HardwareProfile
from flexmarl_hpc.sim.perturb import Perturbation, Perturber
from flexmarl_hpc.sim.placement import sync_network
from flexmarl_hpc.sim.transport import SimTransport, SyntheticWorkers

QWEN_VOCAB = 152064
"""Vocabulary the cost model prices (Qwen2.5's): the tasks' own vocabularies are tiny."""


@dataclass(frozen=True)
class Workload:
    """What the synthetic responses stand for."""
    prompt_tokens: int = 1024
    """Modelled prompt length of every request (assumption: the paper gives none)."""
    lengths: LengthDistribution = LengthDistribution()
    """Modelled response lengths (lognormal, median 1024, sigma 0.8, max 8192)."""
    vocab: int = QWEN_VOCAB
    """Vocabulary of the priced models (embedding and LM head parameters)."""
    seed: int = 0
    """Seed of the modelled lengths (the simulation is deterministic given it)."""
    prompts: Mapping[str, int] = field(default_factory=dict)
    """Per agent its prompt, where it differs from `prompt_tokens` (context grown along a
    chain: sim.workload.TaskSpec.prompts)."""
    agent_lengths: Mapping[str, LengthDistribution] = field(default_factory=dict)
    """Per agent its lengths, where they differ from `lengths` (sim.workload.TaskSpec.lengths)."""

    def prompt_for(self, agent: str) -> int:
        return self.prompts.get(agent, self.prompt_tokens)

    def lengths_for(self, agent: str) -> LengthDistribution:
        return self.agent_lengths.get(agent, self.lengths)


def agent_shape(cfg: Config, agent: str, vocab: int, bytes_per_param: int = 2) -> ModelShape:
    """The shape of `agent`'s model in `cfg`, with a vocabulary of `vocab`."""
    return shape_from_model_args(types.SimpleNamespace(**{**to_dict(cfg.model_for(agent)), "vocab_size": vocab}),
                                 agent, bytes_per_param)


def cost_model(plan: Plan, hw: HardwareProfile, vocab: int = QWEN_VOCAB, bytes_per_param: int = 2) -> CostModel:
    """Each agent's model, replica width (its first pool) and trainer group (where it starts);
    bytes_per_param 4 for the CPU runs' fp32 models."""
    cfg, pools, groups = plan.cfg, plan.pools, plan.groups
    t = cfg.trainer
    agents = {}
    for agent in cfg.agent_names:
        shape = agent_shape(cfg, agent, vocab, bytes_per_param)
        pool = next(p for p in pools if agent in p.agents)
        group = next((g for g in groups if agent in g.agents), groups[0])
        again = recompute_fraction(t.recompute, t.recompute_method, t.recompute_num_layers, shape.layers,
                                   group.pipeline_parallel) if group.backend == "megatron" else 0.0
        agents[agent] = AgentLayout(shape, gpus_per_replica=pool.gpus_per_replica, trainer_devices=group.ranks,
                                trainer_tp=group.tensor_parallel, trainer_pp=group.pipeline_parallel,
                                max_num_seqs=max(cfg.rollout.max_batch, 1), recompute=again)
    return CostModel(hw, agents)


class ModelledCost:
    """`cost` (a sim.costs.CostModel) charged for modelled, not real, lengths."""

    def __init__(self, cost: CostModel, work: Workload) -> None:
        self.cost, self.work = cost, work
        self.hw = getattr(cost, "hw", None)
        self.rng = np.random.default_rng(work.seed)
        self._means: dict[str, float] = {}

    def mean_len(self, agent: str) -> float:
        """The agent's mean modelled length (of a fixed-seed sample: the same in every run)."""
        if agent not in self._means:
            self._means[agent] = float(self.work.lengths_for(agent).sample(np.random.default_rng(12345), 100_000).mean())
        return self._means[agent]

    def generate_s(self, agent, n_prompts, prompt_tokens, response_tokens) -> float:
        lengths = self.work.lengths_for(agent).sample(self.rng, len(response_tokens))
        prompt = self.work.prompt_for(agent)
        self.last_tokens = (n_prompts * prompt, int(lengths.sum()))   # message sizes
        return self.cost.generate_s(agent, n_prompts, prompt, lengths)

    def train_tokens(self, arrays: dict, agent: str | None = None) -> int:
        rows = int(np.count_nonzero(np.asarray(arrays["response_lens"])))
        if agent is None:
            return int(rows * (self.work.prompt_tokens + self.mean_len("")))
        return int(rows * (self.work.prompt_for(agent) + self.mean_len(agent)))

    def train_s(self, agent, tokens, optimizer_step=True) -> float:
        return self.cost.train_s(agent, tokens, optimizer_step)

    def sync_s(self, agent, nbytes) -> float:
        return self.cost.sync_s(agent, nbytes)

    def swap_s(self, agent, nbytes) -> float:
        return self.cost.swap_s(agent, nbytes)

    def weight_bytes(self, agent) -> int:
        return self.cost.weight_bytes(agent)

    def state_bytes(self, agent) -> int:
        return self.cost.state_bytes(agent)


WORKERS = ("synthetic", "real")
"""The kinds of simulated workers (`simulate --workers`)."""
REAL_WORKERS_MAX_PARAMS = 2_000_000_000
"""In-process ("real") workers build every agent's model and trainer in one process: above
this many parameters in all, a config is refused (it would not fit, or run for hours)."""


def real_workers_fit(cfg: Config, vocab: int) -> None:
    """Raises ConfigError unless `cfg`'s models may run in-process (sim.inprocess)."""
    total = sum(agent_shape(cfg, agent, vocab).params for agent in cfg.agent_names)
    if total > REAL_WORKERS_MAX_PARAMS:
        raise ConfigError(f"--workers real: builds every agent's model in this process, {total / 1e9:.1f}B "
                          f"parameters in all for {len(cfg.agent_names)} agents, expected at most "
                          f"{REAL_WORKERS_MAX_PARAMS / 1e9:.0f}B; use --workers synthetic for models this size")


def refuse_agent_program(cfg: Config) -> None:
    """The program of workflow.agent runs on the wall clock in a worker and its requests arrive
    over HTTP; the discrete-event clock never waits for them (TODO issue 41: price its calls)."""
    if cfg.workflow.agent:
        raise ValueError("workflow.agent: an `openai` program is not simulated (it runs on the wall "
                         "clock in a worker process); simulate an episode function with its call pattern")


def simulate_run(plan: Plan, cost, out: Path, hardware: str, work: Workload | None = None,
                 charge_orchestrator: bool = False, workers: str = "synthetic",
                 perturb: Perturbation | None = None, wrap=None,
                 colocate: list[tuple[int, int]] = ()) -> tuple[Path, SimTransport]:
    """Run `plan` on the simulated clock (without its tool ranks: plan.in_process); returns
    its HDF5 file (attrs simulated=True, hardware, workers) and the transport (for its clock
    and counters). `workers` "real"
    runs the real engine and trainers in-process (small models; `work` must then be None:
    the real lengths are priced)."""
    from flexmarl_hpc.workflows.build import build_task
    from flexmarl_hpc.orchestrator.loop import Orchestrator
    from flexmarl_hpc.store.tables import StoreFile
    if workers not in WORKERS:
        raise ValueError(f"workers: expected one of {', '.join(WORKERS)}, got {workers!r}")
    if workers == "real" and work is not None:
        raise ValueError("workers='real' prices the real responses: a modelled Workload does not apply")
    # no tool ranks in a simulation: episodes' tool calls run in rank 0's process pool
    plan = plan.in_process()
    cfg, layout = plan.cfg, plan.layout
    refuse_agent_program(cfg)
    task = build_task(cfg)
    if workers == "real":
        from flexmarl_hpc.sim.inprocess import InProcessWorkers
        real_workers_fit(cfg, len(task.vocab))
        content = InProcessWorkers(plan, task)
    else:
        content = SyntheticWorkers(task)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{cfg.run.name}.h5"
    path.unlink(missing_ok=True)
    hw = getattr(cost, "hw", None)                  # a CostModel's profile
    eff = getattr(hw, "efficiency", None)
    if work is not None:
        cost = ModelledCost(cost, work)
    if wrap is not None:                            # a baseline's own costs (sim.baselines.Colocated)
        cost = wrap(cost)
    sim = SimTransport(layout, cost, content,
                       charge_orchestrator=charge_orchestrator,
                       orchestrator_s=eff.orchestrator_s if eff else 0.0,
                       orchestrator_step_s=eff.orchestrator_step_s if eff else 0.0,
                       latency_s=eff.message_latency_s if eff else 0.0,
                       shared_cores=eff.rank_cores() if eff else 0,
                       waiting_share=eff.waiting_share if eff else 0.0,
                       workers_poll=cfg.run.idle_wait == "poll",
                       orchestrator_byte_s=eff.orchestrator_byte_s if eff else 0.0,
                       # a fabric for the syncs where there is one: not on shared cores (one machine)
                       network=(sync_network(plan, hw, colocate) if eff and not eff.shared_cores else None),
                       perturb=Perturber(perturb, layout.world_size) if perturb and perturb.active else None)
    store = StoreFile(path, cfg.agent_names,
                      {"config_yaml": yaml.safe_dump(to_dict(cfg), sort_keys=False), "mode": cfg.run.mode,
                       "world_size": layout.world_size, "simulated": True, "hardware": hardware,
                       "sim_workers": workers},
                      chunk=cfg.store.chunk_rows, clock=sim.clock, undoable=bool(cfg.workflow.episode))
    try:
        code = Orchestrator(plan, task, sim, store, log=lambda line: None, clock=sim.clock).run()
    finally:
        store.close()
    if code != 0:
        raise RuntimeError(f"simulated run {cfg.run.name} ({cfg.run.mode}) ended with code {code}")
    return path, sim


def measure(path: Path, gpus: dict[int, int] | None = None, skip: int = 2, devices: int = 0) -> dict:
    """step_s (median gap between global steps after `skip`), samples/s, and accelerator
    utilization (busy accelerator-seconds / (accelerators x window); `gpus`: rank -> devices;
    `devices`: the physical count, where ranks share devices (a colocated baseline))."""
    with h5py.File(path, "r") as f:
        m, iv = f["metrics"][:], f["intervals"][:]
        world = int(f.attrs["world_size"])
    m = m[m["superseded"] == 0]
    t = m["t"]
    skip = min(skip, max(len(t) - 2, 0))
    lo, hi = (t[skip - 1] if skip else 0.0), t[-1]
    busy = iv["activity"] != b"wait"
    inside = np.clip(np.minimum(iv["t1"], hi) - np.maximum(iv["t0"], lo), 0, None) * busy
    weight = np.ones(world)
    weight[0] = 0.0                                   # the orchestrator is a CPU rank
    for r, g in (gpus or {}).items():
        weight[r] = g
    per_rank = np.bincount(iv["rank"], weights=inside, minlength=world)
    span = max(hi - lo, 1e-12)
    share = lambda sel: float((np.bincount(iv["rank"][sel], weights=inside[sel], minlength=world) * weight).sum()
                              / ((devices or weight.sum()) * span))
    return {"step_s": float(np.median(np.diff(t[max(skip - 1, 0):]))) if len(t) > 1 else float(hi),
            "samples_per_s": float(m["samples"][skip:].sum() / span),
            "util": float((per_rank * weight).sum() / ((devices or weight.sum()) * span)),
            # util split by activity (generate, train, sync, swap...): what the busy time is made of
            "util_parts": {a.decode(): share(iv["activity"] == a) for a in np.unique(iv["activity"][busy])},
            "steps": int(len(t))}


def sync_per_generate(path: Path, replicas: set[int]) -> float:
    """Rank-seconds the `replicas` spent in weight syncs per rank-second generating, over the
    whole run: how much of the rollout side the network takes (0: none)."""
    with h5py.File(path, "r") as f:
        iv = f["intervals"][:]
    mine = np.isin(iv["rank"], list(replicas))
    dur = (iv["t1"] - iv["t0"]) * mine
    gen = float(dur[iv["activity"] == b"generate"].sum())
    return float(dur[iv["activity"] == b"sync"].sum()) / max(gen, 1e-12)


def replica_ranks(plan: Plan) -> set[int]:
    """World ranks of the rollout replicas."""
    layout = plan.layout
    return {r for r in range(1, layout.world_size) if layout.role_of(r)[0] == ROLLOUT}


def rank_devices(plan: Plan) -> dict[int, int]:
    """World rank -> accelerators it stands for (a replica rank holds its pool's width)."""
    layout, pools = plan.in_process().layout, plan.pools
    out = {}
    for r in range(1, layout.world_size):
        role, index = layout.role_of(r)
        out[r] = pools[layout.pool_of(index)].gpus_per_replica if role == ROLLOUT else 1
    return out
