"""Every pure check of a config: field ranges, checks across fields, pools and trainer groups.

    from flexmarl_hpc.config.validate import validate
    validate(cfg)            # ConfigError naming the field and what was expected

`load_config` runs it on every config it returns, and config/plan.resolve runs
`validate_resources` on the pools and groups it resolves. The `slurm:` section is checked only
when a job script is written (config/validate_slurm.py); checks that need the built
task, the machine or the run folder are launch/preflight.py's.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flexmarl_hpc.config.bounds import bound_of
from flexmarl_hpc.config.resources import FIT_FRACTION, Group, Pool, fits, swap_peers, weight_gb
from flexmarl_hpc.config.schema import (AGENT_EPISODE, TOOL_CALL_FORMATS, Config, ConfigError, ModelConfig, RunConfig,
                                        TrainerConfig, WorkflowConfig, join)


# Field ranges are on the fields (config/bounds.py, check_bounds below); launch/preflight.py
# adds the checks that need the task or the machine: sequence lengths, the number of ranks a
# local run may start
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")
"""Agent names become HDF5 group and checkpoint folder names."""


def _need(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{where}: {msg}")


def check_bounds(obj: Any, where: str = "") -> None:
    """Every numeric field of `obj` (a config dataclass, nested ones, lists and mappings of
    them) inside the bounds written on it (config/bounds.py); a tuple's bound holds for each
    element (`trainer.betas[0]`). Raises ConfigError `field: expected RANGE, got VALUE`."""
    for f in dataclasses.fields(obj):
        value, path, bound = getattr(obj, f.name), join(where, f.name), bound_of(f)
        if bound is not None:
            for w, v in (((f"{path}[{i}]", v) for i, v in enumerate(value))
                         if isinstance(value, (list, tuple)) else ((path, value),)):
                bound.check(v, w)
        elif dataclasses.is_dataclass(value):
            check_bounds(value, path)
        elif isinstance(value, (list, dict)):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, item in items:
                if dataclasses.is_dataclass(item):
                    check_bounds(item, f"{path}.{k}" if isinstance(value, dict) else f"{path}[{k}]")


UNPRINTABLE = frozenset({"Cc", "Cf", "Zl", "Zp", "Zs"})
"""Unicode categories refused in config strings: controls (incl. C1 such as U+0085 NEL, a
line break to some tools), format characters (bidi overrides, zero-width joiners: text
that displays otherwise than it reads) and line/paragraph/space separators other than ' '."""


def _unprintable(text: str) -> str | None:
    return next((c for c in text if c != " " and unicodedata.category(c) in UNPRINTABLE), None)


def check_leaves(obj: Any, where: str = "") -> None:
    """Every float is finite and no string (nor mapping key) holds a control, format or
    separator character other than ' ': strings reach file names, HDF5 attributes and the
    sbatch script, where a newline splits a line."""
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            check_leaves(getattr(obj, f.name), join(where, f.name))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_leaves(v, f"{where}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            check_leaves(k, where)
            check_leaves(v, f"{where}.{k}")
    elif isinstance(obj, float):
        _need(math.isfinite(obj), where, f"expected a finite number, got {obj!r}")
    elif isinstance(obj, str):
        bad = _unprintable(obj)
        if bad is not None:
            raise ConfigError(f"{where}: unprintable character {bad!r} (U+{ord(bad):04X}, category "
                              f"{unicodedata.category(bad)}) in {obj!r}; expected printable text, ' ' "
                              "the only space (it would reach file names and the sbatch script)")


def _validate_run(r: RunConfig) -> None:
    _need(bool(r.name) and "/" not in r.name and r.name not in (".", ".."), "run.name",
          f"expected a non-empty name without '/', got {r.name!r}")
    _need(bool(r.output_dir), "run.output_dir", "expected a folder")
    try:
        r.output_dir.format(name=r.name)
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        raise ConfigError(f"run.output_dir: only {{name}} may appear in braces (double them for a "
                          f"literal brace), got {r.output_dir!r} ({type(e).__name__}: {e})") from None


def _validate_model(m: ModelConfig, where: str) -> None:
    _need(m.hidden_size % m.num_heads == 0, f"{where}.num_heads",
          f"hidden_size {m.hidden_size} is not divisible by num_heads {m.num_heads}")
    _need(m.num_heads % m.num_kv_heads == 0, f"{where}.num_kv_heads",
          f"num_heads {m.num_heads} is not divisible by num_kv_heads {m.num_kv_heads}")
    _need((m.hidden_size // m.num_heads) % 2 == 0, f"{where}.hidden_size",
          "head dim (hidden_size / num_heads) must be even for RoPE")
    if m.checkpoint:
        _need(Path(m.checkpoint).is_dir(), f"{where}.checkpoint",
              f"expected a local HF checkpoint folder, {m.checkpoint!r} does not exist")


def _validate_bucket_row(cfg: Config, agent: str) -> None:
    """A tensor larger than a sync bucket goes in pieces of whole rows (runtime/weight_sync):
    a bucket must hold one row of each, in fp32 (the widest wire dtype). A checkpoint's
    shapes are its config.json's here (config/checkpoint.py, run by load_config)."""
    m = cfg.model_for(agent)
    row = 4 * max(m.hidden_size, m.intermediate_size)
    _need(row <= cfg.weight_sync.bucket_mb * 2**20, "weight_sync.bucket_mb",
          f"a bucket of {cfg.weight_sync.bucket_mb} MiB cannot hold one row of {agent}'s weights "
          f"({row} B: 4 x max(hidden_size, intermediate_size)); expected at least {row / 2**20:.4g} MiB")


def _validate_workflow(w: WorkflowConfig) -> None:
    _need(not w.reward or bool(w.agent), "workflow.reward",
          f"expected none without workflow.agent (an episode function returns its rewards), got {w.reward!r}")
    if w.episode:
        return _validate_episode(w)
    _need(len(w.turns) > 0, "workflow.turns", "expected at least one turn")
    for i, t in enumerate(w.turns):
        _need(bool(NAME_RE.match(t.agent)), f"workflow.turns[{i}].agent",
              f"expected an agent name of letters, digits, _ . + - (it names HDF5 groups and "
              f"checkpoint folders), got {t.agent!r}")
    _need(":" in w.task, "workflow.task", f"expected 'module:Class', got {w.task!r}")


def _validate_episode(w: WorkflowConfig) -> None:
    _need(":" in w.episode, "workflow.episode", f"expected 'module:function', got {w.episode!r}")
    _need(not w.turns, "workflow.turns", "expected none with workflow.episode (the episode "
          "function decides who is called)")
    _need(isinstance(w.agents, list) and len(w.agents) > 0, "workflow.agents",
          "expected the list of agents the episode function calls")
    for i, a in enumerate(w.agents):
        _need(isinstance(a, str) and bool(NAME_RE.match(a)), f"workflow.agents[{i}]",
              f"expected an agent name of letters, digits, _ . + -, got {a!r}")
    _need(len(set(w.agents)) == len(w.agents), "workflow.agents", "expected distinct names")
    # (on_error's values and the rate's type: the loader, Literal and float; its range: its bound)
    for agent, fmt in w.tool_formats.items():
        _need(agent in w.agents, f"workflow.tool_formats.{agent}", f"expected an agent of {w.agents}")
        _need(fmt in TOOL_CALL_FORMATS, f"workflow.tool_formats.{agent}",
              f"expected one of {sorted(TOOL_CALL_FORMATS)}, got {fmt!r}")
    if w.agent:
        _validate_agent(w)


def _validate_agent(w: WorkflowConfig) -> None:
    """workflow.agent: an `openai` program served by the built-in adapter episode."""
    _need(":" in w.agent, "workflow.agent", f"expected 'module:function', got {w.agent!r}")
    _need(w.episode == AGENT_EPISODE, "workflow.episode",
          f"expected none with workflow.agent (the agent program is the episode), got {w.episode!r}")
    _need(not w.reward or ":" in w.reward, "workflow.reward", f"expected 'module:function', got {w.reward!r}")


def validate(cfg: Config) -> None:
    """Every field's range, then checks that need more than one field. Raises ConfigError
    naming the field and what was expected; runs before any rank starts."""
    need = _need
    check_leaves(cfg)
    check_bounds(cfg)
    _validate_run(cfg.run)
    _validate_workflow(cfg.workflow)
    for name in cfg.agents:
        need(name in cfg.agent_names, f"agents.{name}",
             f"no such agent in the workflow (agents are {cfg.agent_names})")
    for agent in cfg.agent_names:
        where = f"agents.{agent}" if agent in cfg.agents else "model"
        _validate_model(cfg.model_for(agent), where)
        _validate_bucket_row(cfg, agent)
    mp = cfg.trainer.tensor_parallel * cfg.trainer.pipeline_parallel
    need(cfg.trainer.ranks_per_group % mp == 0, "trainer.ranks_per_group",
         f"expected a multiple of tensor_parallel x pipeline_parallel = {mp}, "
         f"got {cfg.trainer.ranks_per_group}")
    need(cfg.trainer.backend == "megatron" or mp == 1, "trainer.tensor_parallel",
         "tensor/pipeline parallelism needs trainer.backend=megatron")
    # megatron's reference model (kl_coef > 0) runs outside the pipeline schedule
    need(cfg.trainer.kl_coef == 0 or cfg.trainer.pipeline_parallel == 1, "trainer.kl_coef",
         f"expected 0 with trainer.pipeline_parallel={cfg.trainer.pipeline_parallel} (the KL "
         f"reference model runs with pipeline_parallel=1 only), got {cfg.trainer.kl_coef}")
    n_agents = len(cfg.agent_names)
    if cfg.num_trainer_groups < n_agents and not cfg.pipeline.swap_states and not cfg.trainer.named_groups:
        orphan = cfg.agent_names[cfg.num_trainer_groups]
        raise ConfigError(
            f"trainer.groups: {cfg.num_trainer_groups} groups for {n_agents} agents leaves agent "
            f"{orphan!r} with no trainer; set trainer.groups=0 or pipeline.swap_states=true")
    need(cfg.num_trainer_groups <= n_agents or bool(cfg.trainer.named_groups), "trainer.groups",
         f"expected at most {n_agents} (one per agent), got {cfg.num_trainer_groups}")
    need(cfg.pipeline.overprovision == 0 or cfg.run.mode == "flex", "pipeline.overprovision",
         "needs run.mode=flex (sync, the baseline, trains every input it admits)")
    _validate_episode_run(cfg, n_agents)

    # --- rollout engine dtype (rollout/vllm_engine.py) ---
    need(cfg.rollout.dtype in ("auto", "fp32") or cfg.rollout.backend == "vllm", "rollout.dtype",
         "the torch engine runs fp32; bf16/fp16 need rollout.backend=vllm")

    # -- run.loggers (metric sinks, flexmarl_hpc/orchestrator/sinks.py) ---------------------------------
    loggers = cfg.run.loggers
    need(len(set(loggers)) == len(loggers), "run.loggers", f"a logger is listed twice: {loggers}")
    for name in loggers:
        need(importlib.util.find_spec(name) is not None, "run.loggers",
             f"{name!r} needs the {name} package: pip install -r requirements-loggers.txt")

    _validate_trainer_engine(cfg.trainer, need)


def _validate_episode_run(cfg: Config, n_agents: int) -> None:
    """What an episode workflow (or its absence) asks of the other sections."""
    _need(cfg.tools.ranks == 0 or bool(cfg.workflow.episode), "tools.ranks",
          f"expected 0 without workflow.episode (only episode functions call tools), got {cfg.tools.ranks}")
    if cfg.workflow.episode:
        _need(cfg.pipeline.overprovision == 0, "pipeline.overprovision",
              "expected 0 with workflow.episode (an example's calls are known only once it ends)")
        _need(cfg.run.eval_every == 0 or bool(cfg.workflow.dataset.eval), "workflow.dataset.eval",
              f"expected a held-out file with run.eval_every={cfg.run.eval_every} (the episodes it evaluates)")
        _need(cfg.run.eval_samples == 0, "run.eval_samples",
              f"expected 0 with workflow.episode (its evaluation is greedy), got {cfg.run.eval_samples}")
        without = [a for a in cfg.agent_names if not cfg.model_for(a).checkpoint]   # none: chat.py synthetic tokenizer
        _need(len(without) in (0, n_agents), "model.checkpoint", "expected a checkpoint folder with a tokenizer "
              f"and chat template for every agent of an episode workflow or for none, got none for {without}")
        for agent in cfg.agent_names:
            _check_tokenizer_files(cfg, agent)


EPISODE_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""What an episode workflow reads from each checkpoint folder (workflows/chat.py ChatTokenizer):
the tokenizer, and the special tokens and chat template (the template may instead be a
chat_template.jinja beside tokenizer_config.json)."""


def _check_tokenizer_files(cfg: Config, agent: str) -> None:
    folder = cfg.model_for(agent).checkpoint
    if not folder or not Path(folder).is_dir():
        return                      # random init (synthetic tokenizer), or refused at load already
    missing = [f for f in EPISODE_TOKENIZER_FILES if not (Path(folder) / f).is_file()]
    where = f"agents.{agent}.checkpoint" if agent in cfg.agents else "model.checkpoint"
    _need(not missing, where, f"{folder} has no {' and no '.join(missing)}: an episode workflow needs "
          f"the checkpoint's tokenizer and chat template ({', '.join(EPISODE_TOKENIZER_FILES)}; copy "
          "them from the model the weights came from)")


# -- trainer engine fields (megatron precision, overlap, pipeline schedule) ------------------
def _validate_trainer_engine(t: TrainerConfig, need) -> None:
    megatron_only = {"precision": t.precision in ("auto", "fp32"), "recompute": t.recompute == "none",
                     "overlap_grad_reduce": not t.overlap_grad_reduce,
                     "overlap_param_gather": not t.overlap_param_gather,
                     "pipeline_microbatches": t.pipeline_microbatches == 0}
    # with trainer.named_groups each group has its own backend: the options apply to its
    # megatron groups, so one megatron group is enough
    backends = {g.backend for g in t.named_groups} or {t.backend}
    for name, default in megatron_only.items():
        need("megatron" in backends or default, f"trainer.{name}",
             "needs a megatron trainer: trainer.backend=megatron, or a trainer.named_groups entry "
             "with backend megatron (the option applies to those groups)")



# ---------------------------------------------------------------------------------------
# pools and trainer groups (flexmarl_hpc.config.resources)
# ---------------------------------------------------------------------------------------
def _check_names(items: list, kind: str, where: str, agents: list[str]) -> None:
    seen = set()
    for i, it in enumerate(items):
        if it.name:
            _need(bool(NAME_RE.match(it.name)), f"{where}[{i}].name",
                  f"expected letters, digits, _ . + - (it labels a het component), got {it.name!r}")
            _need(it.name not in seen, f"{where}[{i}].name", f"{kind} name {it.name!r} is used twice")
            seen.add(it.name)
        for a in it.agents:
            _need(a in agents, f"{where}[{i}].agents", f"no agent {a!r} in workflow.turns (agents are {agents})")


def _validate_pools(cfg: Config, pools: Sequence[Pool]) -> None:
    agents = cfg.agent_names
    _check_names(cfg.rollout.pools, "pool", "rollout.pools", agents)
    for i, p in enumerate(cfg.rollout.pools):
        w = f"rollout.pools[{i}]"
        cap = FIT_FRACTION * p.gpus_per_replica * p.gpu_memory_gb
        for a in p.agents:
            _need(fits(cfg, a, p.gpus_per_replica, p.gpu_memory_gb), f"{w}.gpus_per_replica",
                  f"pool too small for agent {a!r}: its model's weights take {weight_gb(cfg, a):.1f} GB, "
                  f"a replica of {p.gpus_per_replica} x {p.gpu_memory_gb:g} GB GPUs holds {cap:.1f} GB "
                  f"({FIT_FRACTION:.0%}); raise gpus_per_replica or serve {a!r} from a bigger pool")
        if cfg.rollout.backend == "vllm" and p.slurm.gpus_per_node:
            for a in pools[i].agents:
                m = cfg.model_for(a)
                _need(m.num_heads % p.gpus_per_replica == 0 and m.num_kv_heads % p.gpus_per_replica == 0,
                      f"{w}.gpus_per_replica", f"vLLM's tensor parallelism {p.gpus_per_replica} does not "
                      f"divide the {m.num_heads} heads / {m.num_kv_heads} KV heads of agent {a!r}"
                      f"{_shape_source(m)}")
    served = {a for p in pools for a in p.agents}
    for a in agents:
        _need(a in served, "rollout.pools", f"no pool can serve agent {a!r} (its weights take "
              f"{weight_gb(cfg, a):.1f} GB; list it in a pool's agents, or add a pool it fits)")


def _validate_groups(cfg: Config, groups: Sequence[Group]) -> None:
    tr, agents = cfg.trainer, cfg.agent_names
    named = tr.named_groups
    if named:
        _need(tr.groups == 0, "trainer.groups", "expected 0 with trainer.named_groups (the list sets the groups)")
        _check_names(named, "group", "trainer.named_groups", agents)
        owner: dict[str, int] = {}
        for i, g in enumerate(named):
            for a in g.agents:
                _need(a not in owner, f"trainer.named_groups[{i}].agents",
                      f"agent {a!r} is already on trainer.named_groups[{owner.get(a)}]")
                owner[a] = i
        for a in agents:
            _need(a in owner, "trainer.named_groups", f"agent {a!r} has no trainer group; list it in "
                  "one group's agents")
    for i, g in enumerate(groups):
        w = g.where
        mp = g.tensor_parallel * g.pipeline_parallel
        _need(g.ranks % mp == 0, f"{w}.ranks" if named else "trainer.ranks_per_group",
              f"expected a multiple of tensor_parallel x pipeline_parallel = {mp}, got {g.ranks}")
        _need(g.backend == "megatron" or mp == 1, f"{w}.tensor_parallel" if named else "trainer.tensor_parallel",
              "tensor/pipeline parallelism needs backend megatron")
        if named:
            _need(bool(g.agents) or bool(g.swap), f"{w}.agents",
                  "expected at least one agent (or a swap label, to host agents of its swap domain)")
            _need(len(g.agents) <= 1 and not g.swap or cfg.pipeline.swap_states, "pipeline.swap_states",
                  f"{w} holds {len(g.agents)} agents / swap label {g.swap!r}: its agents take turns, "
                  "which needs pipeline.swap_states=true")
        for a in _domain_agents(groups, i):
            m = cfg.model_for(a)
            tp_where = f"{w}.tensor_parallel" if named else "trainer.tensor_parallel"
            pp_where = f"{w}.pipeline_parallel" if named else "trainer.pipeline_parallel"
            _need(m.num_heads % g.tensor_parallel == 0 and m.num_kv_heads % g.tensor_parallel == 0, tp_where,
                  f"{g.tensor_parallel} does not divide the {m.num_heads} heads / "
                  f"{m.num_kv_heads} KV heads of agent {a!r}{_shape_source(m)}")
            _need(m.num_layers % g.pipeline_parallel == 0, pp_where,
                  f"{g.pipeline_parallel} does not divide the {m.num_layers} layers of agent {a!r}{_shape_source(m)}")
    for i, g in enumerate(groups):
        for h in swap_peers(groups, i)[1:]:
            # megatron reshards a state into another TP/PP (runtime/reshard.py); the move pairs
            # rank i of each group, so the ranks (and the backend) must agree
            same = groups[h].shape == g.shape or (g.backend == groups[h].backend == "megatron"
                                                   and g.ranks == groups[h].ranks)
            _need(same, f"{groups[h].where}.swap",
                  f"swap domain {g.swap!r} joins {g.name} ({g.describe()}) and {groups[h].name} "
                  f"({groups[h].describe()}); states swap only between groups of the same ranks and "
                  "backend (TP/PP may differ on megatron)")


def _shape_source(m: ModelConfig) -> str:
    """Where a model's shapes come from, for messages: a checkpoint's config.json (load_config
    read them from it) or the config's model fields."""
    return f" (from {Path(m.checkpoint) / 'config.json'})" if m.checkpoint else ""


def _domain_agents(groups: Sequence[Group], g: int) -> list[str]:
    return [a for h in swap_peers(groups, g) for a in groups[h].agents]


def validate_resources(cfg: Config, pools: Sequence[Pool], groups: Sequence[Group]) -> None:
    """The checks that read the resolved pools and trainer groups: config/plan.resolve runs
    them on its own resolution, before it lays out ranks from them."""
    _validate_pools(cfg, pools)
    _validate_groups(cfg, groups)
    _validate_recompute(cfg, groups)


def _validate_recompute(cfg: Config, groups: Sequence[Group]) -> None:
    """recompute_method / _num_layers shape recompute=full only (megatron refuses them with
    selective); the count is 1 .. the layers of a pipeline stage of each megatron group."""
    t = cfg.trainer
    if t.recompute != "full":
        for key, default in (("recompute_method", "uniform"), ("recompute_num_layers", 1)):
            _need(getattr(t, key) == default, f"trainer.{key}",
                  f"applies to trainer.recompute=full only (recompute is {t.recompute!r}); leave it at {default!r}")
        return
    n = t.recompute_num_layers                   # >= 1: its bound
    for i, g in enumerate(groups):
        if g.backend != "megatron":
            continue
        for a in _domain_agents(groups, i):
            per_stage = cfg.model_for(a).num_layers // g.pipeline_parallel
            _need(n <= per_stage, "trainer.recompute_num_layers",
                  f"{n} is more than the {per_stage} layers per pipeline stage of agent {a!r} on "
                  f"{g.where} ({cfg.model_for(a).num_layers} layers / pipeline_parallel {g.pipeline_parallel})")

