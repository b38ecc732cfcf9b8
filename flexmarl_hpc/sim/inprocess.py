"""Reply content from the real engine and trainers, run in the simulator's process (small
models): a simulated run then trains the same weights as an MPI run of the same config.

One engine serves every simulated replica (sampling is seeded per sample, so which replica
ran a request, or what shared its batch, does not change it); it loads the weights a `Sync`
published for the version a `Generate` asks for. One trainer per agent, on a one-rank
group (trainer.ranks_per_group must be 1), stays live: a state move only costs time.
"""
from __future__ import annotations

from mpi4py import MPI

from flexmarl_hpc.runtime import messages
from flexmarl_hpc.ranks.build import build_engine, build_trainer
from flexmarl_hpc.store.checkpoint import save_checkpoint
from flexmarl_hpc.config.plan import Plan
from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.rollout.base import GenRequest
from flexmarl_hpc.learn.sampling import SamplingParams
from flexmarl_hpc.trainer.base import train_micro
from flexmarl_hpc.runtime.microbatch import microbatch_from_arrays
from flexmarl_hpc.ranks.workers import group_sum


class InProcessWorkers:
    def __init__(self, plan: Plan, task) -> None:
        cfg = plan.cfg
        if cfg.trainer.ranks_per_group != 1:
            raise ConfigError("trainer.ranks_per_group: the in-process simulation runs one trainer "
                              f"rank per agent, expected 1, got {cfg.trainer.ranks_per_group}")
        self.engine = build_engine(plan, task)
        self.trainers = {agent: build_trainer(plan, task, agent, MPI.COMM_SELF) for agent in cfg.agent_names}
        self.params = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p)
        self.window = plan.steps_in_flight   # versions a request may still ask for
        self.ckpt_dir, self.keep_ckpt = cfg.output_dir / "checkpoints", cfg.run.keep_checkpoints
        self.published: dict[tuple[str, int], dict] = {}
        self.acc: dict[str, dict[str, float]] = {}

    def generate(self, cmd: messages.Generate) -> list[tuple[list[int], list[float]]]:
        if self.engine.version(cmd.agent) != cmd.version:
            self.engine.load_weights(cmd.agent, cmd.version, self.published[cmd.agent, cmd.version])
        gens = self.engine.generate(cmd.agent, [GenRequest(*r) for r in cmd.requests], cmd.params or self.params)
        return [(g.tokens, g.logprobs) for g in gens]

    def sync(self, cmd: messages.Sync) -> None:
        tr = self.trainers[cmd.agent]
        if tr.version != cmd.version:
            raise RuntimeError(f"sync of {cmd.agent} v{cmd.version} but its trainer is at v{tr.version}")
        # a copy: the trainer's parameters change under it before a replica loads them
        self.published[cmd.agent, cmd.version] = {k: v.detach().clone()
                                                  for k, v in tr.named_weights().items()}
        old = cmd.version - self.window               # the newest `window` versions stay
        for key in [k for k in self.published if k[0] == cmd.agent and k[1] <= old]:
            del self.published[key]

    def train(self, cmd: messages.Train) -> dict[str, float]:
        """What trainer_loop does on a one-rank group: statistics summed over the step's
        micro-batches, then the optimizer step (and trainer.ppo_epochs' replays)."""
        tr = self.trainers[cmd.agent]
        mb = tr.share(microbatch_from_arrays(cmd.arrays))
        summed = train_micro(tr, mb, cmd.scale, cmd.last, self.acc.setdefault(cmd.agent, {}),
                             lambda d: group_sum(MPI.COMM_SELF, d))
        return {} if summed is None else summed

    def checkpoint(self, cmd: messages.Checkpoint) -> None:
        for name in cmd.agents:
            state = self.trainers[name].state()
            save_checkpoint(self.ckpt_dir / name, int(state["version"]), state, self.keep_ckpt)
