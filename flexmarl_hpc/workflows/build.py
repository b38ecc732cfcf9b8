"""config -> the run's task (a Task of workflows/base.py, or an episode workflow's
EpisodeTask), and the check, before any rank starts, that each agent's model fits it.
"""
from __future__ import annotations

from flexmarl_hpc.config.hf_config import model_args
from flexmarl_hpc.config.schema import Config, ConfigError
from flexmarl_hpc.workflows.base import Task, load_task


def build_task(cfg: Config) -> Task:
    if cfg.workflow.episode:                     # an episode workflow (workflows/episode.py)
        from flexmarl_hpc.workflows.episode_task import EpisodeTask
        return EpisodeTask(cfg)
    return load_task(cfg.workflow.task, cfg.workflow.task_args, [t.agent for t in cfg.workflow.turns])


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
