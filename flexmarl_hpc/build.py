"""config -> objects: the task, each agent's model, the rollout engine, the trainers.

The only place that maps `backend` strings to classes; heavy backends are imported here
lazily so a torch-only job never imports megatron or vllm.
"""
from __future__ import annotations

from .config import Config
from .config import ConfigError
from .model import CausalLM, ModelArgs, build_model, load_hf_args, load_hf_checkpoint
from .sampling import sample_seed
from .workflows.base import Task, load_task


def build_task(cfg: Config) -> Task:
    return load_task(cfg.workflow.task, cfg.workflow.task_args, [t.agent for t in cfg.workflow.turns])


def model_args(cfg: Config, task: Task, agent: str) -> ModelArgs:
    m = cfg.model_for(agent)
    if m.checkpoint:
        return load_hf_args(m.checkpoint)
    return ModelArgs.from_config(m, len(task.vocab))


def check_models(cfg: Config, task: Task) -> None:
    """Before any rank starts: every agent's model can read and write the task's tokens."""
    for agent in cfg.agent_names:
        if not cfg.model_for(agent).checkpoint:
            continue
        where = f"agents.{agent}.checkpoint" if agent in cfg.agents else "model.checkpoint"
        try:
            args = model_args(cfg, task, agent)
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"{where}: {e}") from None
        if args.vocab_size < len(task.vocab):
            raise ConfigError(f"{where}: the model's vocabulary ({args.vocab_size}) is smaller than the "
                              f"task's ({len(task.vocab)} tokens); use the model's own tokenizer in "
                              "workflow.task_args")


def initial_model(cfg: Config, task: Task, agent: str) -> CausalLM:
    """Version 0 of an agent: a local HF checkpoint, or random init seeded by (seed, agent)."""
    m = cfg.model_for(agent)
    if m.checkpoint:
        return load_hf_checkpoint(m.checkpoint)
    seed = sample_seed(cfg.run.seed, agent, 0, "init")
    return build_model(ModelArgs.from_config(m, len(task.vocab)), seed, m.init_std)


def build_engine(cfg: Config, task: Task):
    args_of = {a: model_args(cfg, task, a) for a in cfg.agent_names}
    if cfg.rollout.backend == "vllm":
        from .rollout.vllm_engine import VLLMEngine
        return VLLMEngine(args_of, task, cfg.rollout)
    from .rollout.torch_engine import TorchEngine
    return TorchEngine(args_of, task, cfg.rollout.max_batch)


def build_trainer(cfg: Config, task: Task, agent: str, group_comm):
    """One agent's trainer backend on this rank's group, at version 0."""
    model = initial_model(cfg, task, agent)
    if cfg.trainer.backend == "megatron":
        from .trainer.megatron import MegatronTrainer
        return MegatronTrainer(model.args, cfg.trainer, group_comm, cfg.rollout.temperature,
                               init={k: v.clone() for k, v in model.state_dict().items()})
    from .trainer.torch_trainer import TorchTrainer
    return TorchTrainer(model, cfg.trainer, group_comm, cfg.rollout.temperature)


def initial_placement(cfg: Config):
    """Agent i's state starts on group i % G: resident for the first agent of a group,
    parked in that group's host memory for the others (agent-centric allocation)."""
    from .state_swap import Location
    G = cfg.num_trainer_groups
    return {a: Location(i % G, resident=i < G) for i, a in enumerate(cfg.agent_names)}


def build_mover(cfg: Config, task: Task, world, group_index: int, group_comm, layout):
    """This rank's StateMover holding the group's initial agents (see initial_placement)."""
    from .state_swap import StateMover, to_host
    mover = StateMover(world, group_comm, group_index, layout.group_ranks, {},
                       lambda agent: build_trainer(cfg, task, agent, group_comm))
    for agent, loc in initial_placement(cfg).items():
        if loc.group != group_index:
            continue
        tr = build_trainer(cfg, task, agent, group_comm)
        if loc.resident:
            mover.trainers[agent] = tr
        else:
            mover.parked[agent] = to_host(tr.state())
    return mover
