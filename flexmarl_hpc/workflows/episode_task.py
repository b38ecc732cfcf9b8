"""The task of an episode workflow: what replicas, trainers and the orchestrator need of it.

Built from the config (`workflow.episode` set): each agent's chat tokenizer (its checkpoint
folder's tokenizer.json and chat template; with no `model.checkpoint` at all, the synthetic
byte-level ChatML tokenizer of workflows/chat.py for random-init models), the dataset stream, and the runner that steps
episode coroutines. Replicas and trainers use only `vocab` (pad id, size) and
`stop_tokens`; the orchestrator also `stream` and `runner`.
"""
from __future__ import annotations

from functools import cached_property

from flexmarl_hpc.config.schema import Config
from flexmarl_hpc.config.tools import read_function
from flexmarl_hpc.workflows.base import Task, TokenizerVocab
from flexmarl_hpc.workflows.chat import ChatTokenizer, Conversation, SyntheticChatTokenizer
from flexmarl_hpc.workflows.episode import EpisodeRunner, load_episode
from flexmarl_hpc.workflows.openai_agent import agent_episode


class EpisodeTask(Task):
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.fn = agent_episode(cfg.workflow) if cfg.workflow.agent else load_episode(cfg.workflow.episode)
        folders = {agent: cfg.model_for(agent).checkpoint for agent in cfg.agent_names}
        self.synthetic = not any(folders.values())
        if self.synthetic:                  # random init everywhere: no tokenizer to read
            self.chat = {"": SyntheticChatTokenizer()}
            self.chat_of = {agent: self.chat[""] for agent in folders}
            self.vocab = self.chat[""]
            self.stop_tokens = frozenset(self.vocab.stop_ids)
            return
        self.chat = {folder: ChatTokenizer(folder) for folder in set(folders.values())}
        self.chat_of = {agent: self.chat[f] for agent, f in folders.items()}
        first = self.chat_of[cfg.agent_names[0]]
        special = first.template.special_tokens
        eos = special.get("eos_token")
        self.vocab = TokenizerVocab(folders[cfg.agent_names[0]], pad=eos, bos=special.get("bos_token") or eos,
                                    eos=eos)
        self.vocab.pad_id = first.pad_id
        self.stop_tokens = frozenset(i for tok in self.chat.values() for i in tok.stop_ids)

    @cached_property
    def filler_ids(self) -> list[int]:
        """Ids a synthetic reply is drawn from (sim.transport.SyntheticWorkers): never a stop
        token, so a reply is as long as its max_tokens; letters with the synthetic tokenizer."""
        if self.synthetic:
            return self.vocab.filler_ids
        return [i for i in range(len(self.vocab)) if i not in self.stop_tokens]

    @cached_property
    def stream(self):
        """The training examples as a stream whose position is the step (workflows/dataset.py)."""
        from flexmarl_hpc.workflows.dataset import ExampleStream
        return ExampleStream.from_config(self.cfg.workflow.dataset, self.cfg.run.seed)

    def context_limits(self, cfg: Config) -> dict[str, int]:
        """Most tokens (prompt + reply) of one call of each agent: its model's max_seq_len,
        and rollout.max_model_len where set."""
        from flexmarl_hpc.config.hf_config import model_args
        cap = cfg.rollout.max_model_len or 1 << 62
        return {agent: min(model_args(cfg, self, agent).max_seq_len, cap) for agent in cfg.agent_names}

    def runner(self, cfg: Config, tools=None, record_tool=None) -> EpisodeRunner:
        """A runner of this workflow's episodes (`tools`: a tools.pool.WorkerPool)."""
        w = cfg.workflow
        runner = EpisodeRunner(self.fn, cfg.agent_names, cfg.run.seed, w.max_new_tokens,
                               lambda agent: Conversation(self.chat_of[agent]), w.episode_args,
                               tools, record_tool, self.context_limits(cfg),
                               (cfg.rollout.temperature, cfg.rollout.top_p), w.tool_formats,
                               {n: read_function(n, spec) for n, spec in cfg.tools.functions.items()})
        runner.agent_wait_s = w.agent_timeout_s
        return runner

    def render(self, path) -> str:
        return "episode call"
