"""The paper's two tasks as workload specs: every number with its source, every unknown a
parameter (`UNKNOWNS`) that `simulate paper --sweep` varies.

A spec drives the simulator through the existing workflow/Task mechanism: the task's config
(its agents, their models, its text episode `workflows/paper_text.py`) gets the paper's batch
shape (`apply`: queries per step, branches per query, micro-batch), its chain of agents and its
trainer groups (`agents_per_group`), and the spec's unknowns as the episode's arguments: per
agent its prompt, which grows along the chain with the context the earlier turns added, and
its response-length distribution, a lognormal whose median differs per agent (the paper's
"skewed inter-agent request patterns"). A config still on `workflow.turns` gets the relay
chain and the modelled lengths (`prompts`, `lengths`: sim.driver.Workload).
Sources (docs/simulator.md, "The paper's tables"):
- paper (as a public reading note of its Tables 2-3 reports it): 4 queries x 16 branches = global batch 64, micro-batch 16,
  responses up to 8,192 tokens, MA = every agent its own Qwen2.5-14B, CA = 14B and 32B;
- the configs' agent counts are the paper's scaling runs (15 x 14B; 3 x 32B + 7 x 14B): the
  paper does not say how many agents MA and CA chain (unknown: `chain_agents`, fitted on MA);
- prompt, context carried and length medians are unknowns (the e-commerce data are not
  public), with defaults stated in `UNKNOWNS`.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

from flexmarl_hpc.sim.costs import LengthDistribution
from flexmarl_hpc.workflows.paper_text import DEFAULTS       # the workload's defaults: one copy


@dataclass(frozen=True)
class TaskSpec:
    """One paper task: its config and the modelled workload's parameters."""

    name: str
    """MA or CA."""
    config: str
    """The config of its agents and allocation (the relay chain of their turns)."""
    agents: tuple[str, ...] = ()
    """The config's agents the chain starts from (MA: 14B ones; CA: a 32B one, then 14B ones)."""
    chain_agents: int = 8
    """UNKNOWN (the paper does not say how many agents MA and CA chain; its scaling runs have
    10 and 15): fitted on MA (`simulate paper --fit`: 8 of 5, 8, 10), CA takes the same count;
    sweep 2-8. The chain's length. The
    agents are `agents`, then the config's other agents in its order, the first `chain_agents`
    of them, chained in the config's order (`chain`)."""
    queries: int = 4
    """Queries per step (paper: 4)."""
    branches: int = 16
    """Responses sampled per query, the first turn's samples (paper: 16)."""
    micro_batch: int = 16
    """Trainer micro-batch (paper: 16)."""
    max_tokens: int = DEFAULTS["max_tokens"]
    """Longest response (paper: 8,192)."""
    prompt_tokens: int = DEFAULTS["prompt_tokens"]
    """UNKNOWN: the first turn's prompt (instructions + query)."""
    context_carried: float = DEFAULTS["context_carried"]
    """UNKNOWN (sweep 0-1): fraction of each earlier turn's response the next turn's prompt
    carries; 0.1 keeps the paper configs' 15-agent chain inside the 8,192-token context."""
    length_median: float = DEFAULTS["length_median"]
    """UNKNOWN: median response length of the median agent."""
    length_sigma: float = DEFAULTS["length_sigma"]
    """UNKNOWN: lognormal sigma of the lengths inside an agent."""
    agent_skew: float = DEFAULTS["agent_skew"]
    """UNKNOWN: lognormal sigma of the agents' medians around `length_median` (inter-agent skew)."""
    replica_width: int = 4
    """UNKNOWN (fitted on MA, `simulate paper --fit`; sweep 1-8): devices per rollout replica
    (its tensor parallelism), at least the config's (14B: 1, 32B: 4), for every system alike.
    The paper does not give its rollout engines' tensor parallelism."""
    agents_per_group: int = 1
    """UNKNOWN (fitted on MA, `simulate paper --fit`; sweep 1-4): agents per FlexMARL trainer
    group. The paper's training engine binds trainers "on demand" through "agent-centric
    resource allocation" and swaps the agents' training states (its abstract), so it needs fewer
    trainer groups than agents; it does not say how many. The config's per-agent groups of one
    shape are merged, `agents_per_group` agents to a group, every group of a shape in one swap
    domain (any of them may take any of its agents); the nodes freed go to the pools. The
    baselines keep their own allocations."""
    settle: bool = DEFAULTS["settle"]
    """UNKNOWN (sweep false/true): each agent's reward is known once its own reply is in
    (a per-agent rule reward, ctx.settle), so its calls train while later agents run; false:
    every reward at the episode's end. The paper's micro-batch pipeline trains a micro-batch
    "as soon as" its samples are in, which presumes the former."""
    seed: int = DEFAULTS["seed"]
    """The workload seed: of the agents' medians (episode_args.seed) and of the run
    (run.seed: each episode's draws of lengths and rewards); `simulate paper` takes every
    figure over seeds 0..4."""

    def apply(self, raw: dict, nodes: int = 47) -> dict:
        """A copy of the config dict `raw` as the task: only the turns of `agents` (the
        chain keeps its order), their pools and trainer groups, the pools grown to fill
        `nodes` (the paper's 48 less the orchestrator's) in proportion to their nodes; the
        paper's batch shape: `queries` inputs per step, `branches` samples at the first turn
        (global batch = queries x branches), micro-batch `micro_batch`."""
        out = copy.deepcopy(raw)
        out.setdefault("run", {})["seed"] = self.seed
        keep = set(self.chain(raw))
        self._workflow(out["workflow"])
        out.setdefault("trainer", {})["micro_batch_size"] = self.micro_batch
        out["agents"] = {a: m for a, m in (out.get("agents") or {}).items() if a in keep}
        groups = self._merged([g for g in out["trainer"]["named_groups"] if set(g["agents"]) <= keep])
        out["trainer"]["named_groups"] = groups
        if any(len(g["agents"]) > 1 for g in groups):
            out.setdefault("pipeline", {})["swap_states"] = True
        pools = []
        for p in out["rollout"]["pools"]:
            p["agents"] = [a for a in p["agents"] if a in keep]
            if p["agents"]:
                pools.append(p)
        free = nodes - sum(g["slurm"]["nodes"] for g in groups)
        was = sum(p["slurm"]["nodes"] for p in pools)
        for i, p in enumerate(pools):
            n = free - sum(q["slurm"]["nodes"] for q in pools[:i]) if i == len(pools) - 1 else \
                max(1, round(free * p["slurm"]["nodes"] / was))
            p["gpus_per_replica"] = max(p["gpus_per_replica"], self.replica_width)
            per_node = p["slurm"]["gpus_per_node"] // p["gpus_per_replica"]
            p["slurm"]["nodes"], p["replicas"] = n, n * per_node
        out["rollout"]["pools"] = pools
        return out

    def _merged(self, groups: list[dict]) -> list[dict]:
        """The one-agent groups `groups` merged `agents_per_group` agents to a group, per shape
        (ranks, parallelism, backend, nodes), each shape one swap domain; as they are at 1."""
        if self.agents_per_group < 1:
            raise ValueError(f"task {self.name}: field 'agents_per_group': expected >= 1, got {self.agents_per_group}")
        if self.agents_per_group == 1:
            return groups
        shapes: dict[tuple, list[dict]] = {}
        for g in groups:
            key = (g["ranks"], g.get("tensor_parallel", 1), g.get("pipeline_parallel", 1), g.get("backend"),
                   g["slurm"]["nodes"])
            shapes.setdefault(key, []).append(g)
        out = []
        for i, same in enumerate(shapes.values()):
            for k in range(0, len(same), self.agents_per_group):
                part = same[k:k + self.agents_per_group]
                out.append({**part[0], "agents": [a for g in part for a in g["agents"]], "swap": f"shape{i}"})
        return out

    def chain(self, raw: dict) -> list[str]:
        """The chain's agents: `agents`, then the config dict's other workflow agents in its
        order, the first `chain_agents`; named errors for an agent not in the config, a
        count below 1 or above the config's agents."""
        wf = raw["workflow"]
        have = list(wf["agents"] if wf.get("episode") else dict.fromkeys(t["agent"] for t in wf["turns"]))
        if set(self.agents) - set(have):
            raise ValueError(f"task {self.name}: field 'agents': {sorted(set(self.agents) - set(have))} are not "
                             f"in {self.config}")
        if not 1 <= self.chain_agents <= len(have):
            raise ValueError(f"task {self.name}: field 'chain_agents': expected 1 to {len(have)} (the agents of "
                             f"{self.config}), got {self.chain_agents}")
        pick = set((list(self.agents) + [a for a in have if a not in self.agents])[:self.chain_agents])
        return [a for a in have if a in pick]

    def _workflow(self, wf: dict) -> None:
        """The chain (`chain`) with the batch shape: a text episode's agents, group and
        lengths (workflows/paper_text.py: `branches` episodes per query), or a relay's turns
        (`branches` samples at the first)."""
        keep = set(self.chain({"workflow": wf}))
        if wf.get("episode"):
            wf["agents"] = [a for a in wf["agents"] if a in keep]
        else:
            wf["turns"] = [t for t in wf["turns"] if t["agent"] in keep]
        wf["inputs_per_step"] = self.queries
        if wf.get("episode"):
            wf["group_size"] = self.branches
            wf["episode_args"] = {**wf.get("episode_args", {}), **{k: getattr(self, k) for k in EPISODE_ARGS}}
            return
        wf["turns"][0]["samples"] = self.branches
        for t in wf["turns"][1:]:
            t["samples"] = 1

    def medians(self, agents: list[str]) -> dict[str, float]:
        """Each agent's median response length: the seeded skew around `length_median`."""
        from flexmarl_hpc.workflows.paper_text import agent_medians      # the text episode's, one formula
        return agent_medians(agents, self.length_median, self.agent_skew, self.seed)

    def prompts(self, agents: list[str]) -> dict[str, int]:
        """Each agent's prompt: turn k carries `context_carried` of turns 0..k-1's mean lengths."""
        med, out, carried = self.medians(agents), {}, 0.0
        for a in agents:
            out[a] = int(round(self.prompt_tokens + carried))
            carried += self.context_carried * self._mean(med[a])
        return out

    def _mean(self, median: float) -> float:
        return min(median * math.exp(self.length_sigma ** 2 / 2), self.max_tokens)

    def lengths(self, agents: list[str]) -> dict[str, LengthDistribution]:
        return {a: LengthDistribution(median=m, sigma=self.length_sigma, max_tokens=self.max_tokens)
                for a, m in self.medians(agents).items()}


EPISODE_ARGS = ("prompt_tokens", "context_carried", "length_median", "length_sigma", "agent_skew", "max_tokens",
                "seed", "settle")
"""The spec's fields a text episode reads (workflows/paper_text.py episode_args)."""
MA = TaskSpec("MA", "configs/paper_15x14b.yaml", agents=("shop14_0", "shop14_1", "shop14_2"))
CA = TaskSpec("CA", "configs/paper_3x32b_7x14b.yaml", agents=("shop32_0", "shop14_0", "shop14_1"))
TASKS = {"MA": MA, "CA": CA}

UNKNOWNS: dict[str, tuple[float, ...]] = {
    "prompt_tokens": (512, 1024, 2048),
    "context_carried": (0.0, 0.1, 1.0),
    "length_median": (512, 1024, 2048),
    "length_sigma": (0.4, 0.8, 1.2),
    "agent_skew": (0.0, 0.5, 1.0),
    "settle": (0, 1),
    "replica_width": (1, 2, 4, 8),
    "chain_agents": (2, 3, 5, 8),
    "agents_per_group": (1, 2, 4),
}
"""Each unknown's sweep: low, (default,) high; the sweep runs the first and the last."""


def with_unknown(spec: TaskSpec, name: str, value: float) -> TaskSpec:
    """`spec` with one unknown changed (named error for a field that is not an unknown)."""
    if name not in UNKNOWNS:
        raise ValueError(f"unknown {name!r}: expected one of {sorted(UNKNOWNS)}")
    kind = type(getattr(spec, name))
    return dataclasses.replace(spec, **{name: kind(value)})
