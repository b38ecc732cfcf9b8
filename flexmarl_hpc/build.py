"""config -> objects: the task, each agent's model, the rollout engine, the trainers.

The only place that maps `backend` strings to classes; heavy backends are imported here
lazily so a torch-only job never imports megatron or vllm.
"""
from __future__ import annotations

from .config import Config
from .model import CausalLM, ModelArgs, build_model, load_hf_checkpoint
from .sampling import sample_seed
from .workflows.base import Task, load_task


def build_task(cfg: Config) -> Task:
    return load_task(cfg.workflow.task, cfg.workflow.task_args, [t.agent for t in cfg.workflow.turns])


def model_args(cfg: Config, task: Task, agent: str) -> ModelArgs:
    m = cfg.model_for(agent)
    if m.checkpoint:
        return load_hf_checkpoint(m.checkpoint).args
    return ModelArgs.from_config(m, len(task.vocab))


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


def build_trainers(cfg: Config, task: Task, group_index: int, group_comm) -> dict:
    """The trainer(s) of one group: the agent(s) bound to it, keyed by agent name."""
    agents = [a for i, a in enumerate(cfg.agent_names) if i % cfg.num_trainer_groups == group_index]
    out = {}
    for agent in agents:
        model = initial_model(cfg, task, agent)
        if cfg.trainer.backend == "megatron":
            from .trainer.megatron_trainer import MegatronTrainer
            out[agent] = MegatronTrainer(model.args, cfg.trainer, group_comm, cfg.rollout.temperature,
                                         init={k: v.clone() for k, v in model.state_dict().items()})
        else:
            from .trainer.torch_trainer import TorchTrainer
            out[agent] = TorchTrainer(model, cfg.trainer, group_comm, cfg.rollout.temperature)
    return out


