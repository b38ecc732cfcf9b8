"""Metric sinks: TensorBoard event files and offline W&B runs, written by the orchestrator.

    run:
      loggers: [tensorboard, wandb]      # default []: neither is imported

The HDF5 store stays the source of truth; a sink is a copy of one row per global step, for
the tools people already watch. Only the orchestrator (world rank 0) writes them, once a
step is committed to the store (`recorder.RunRecorder.log_steps`). Every value is plotted against
the global step, so a resumed run continues its curves instead of starting new ones:

- TensorBoard: `<run_dir>/tensorboard/events.out.tfevents.*`. A resumed process opens the
  writer with `purge_step` = its first step, so steps that an interrupted process logged
  past its checkpoint (and this one logs again) are hidden, not drawn twice.
- W&B: offline (compute nodes have no internet), under `<run_dir>/wandb/offline-run-*`,
  one run id per store file (`<name>-<created>`), every metric against `global_step`.
  Upload afterwards from a login node: `wandb sync <run_dir>/wandb/offline-run-*`.

Tags (one scalar each): `<agent>/reward`, `<agent>/loss`, `<agent>/entropy`, `<agent>/kl`,
`<agent>/grad_norm`, `<agent>/staleness_max`, `<agent>/staleness_mean`, `<agent>/n_samples`,
`run/samples_per_s`, `run/tokens_per_s`, `run/utilization`, `run/staleness_max`,
`run/rollout_s`, `run/train_s`, `run/sync_s`, `run/swap_s`, and `<agent>/eval/<metric>`
for whatever evaluation a caller passes in `extra`.

tensorboard and wandb are optional (requirements-loggers.txt) and imported only here.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Protocol

import numpy as np

LOGGERS = ("tensorboard", "wandb")
"""Names accepted in run.loggers."""
PACKAGE = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""The importable package each logger needs (requirements-loggers.txt installs both)."""

STEP_TAGS = ("reward_mean", "loss", "entropy", "kl", "grad_norm", "staleness_max", "staleness_mean",
             "n_samples")
"""/steps/<agent> columns copied per agent (reward_mean is written as `reward`)."""
OPTIONAL_STEP_TAGS = ("logp_mismatch", "tis_mean", "clip_frac", "ppo_kl")
"""/steps columns copied where the file has them (a file resumed from before they existed
lacks clip_frac and ppo_kl)."""
RUN_TAGS = ("samples_per_s", "utilization", "staleness_max", "rollout_s", "train_s", "sync_s", "swap_s")
"""/metrics columns copied as `run/<column>`."""


class Sink(Protocol):
    def write(self, step: int, scalars: dict[str, float]) -> None: ...
    def close(self) -> None: ...


def step_scalars(store, step: int, metrics: dict, extra: dict[str, float] | None = None) -> dict[str, float]:
    """{tag: value} of one global step: each agent's last /steps row for `step` (read back
    from the store, so a step reloaded on resume gives the same values), the /metrics row
    just appended (`metrics`, column -> [value]) and `extra` (e.g. eval results) as given."""
    out: dict[str, float] = {}
    for agent, tab in store.steps.items():
        row = _last_row_of(tab, step)
        if row is None:
            continue
        names = row.dtype.names or ()
        for col in STEP_TAGS + tuple(c for c in OPTIONAL_STEP_TAGS if c in names):
            out[f"{agent}/{'reward' if col == 'reward_mean' else col}"] = float(row[col])
    for col in RUN_TAGS:
        out[f"run/{col}"] = float(metrics[col][0])
    wall = float(metrics["wall"][0])
    out["run/tokens_per_s"] = float(metrics["tokens"][0]) / wall if wall > 0 else 0.0
    out.update(extra or {})
    return out


def _last_row_of(tab, step: int, tail: int = 16):
    """The last written /steps row of `step`, or None: one read of the table's last rows
    (the step just logged is among them), the whole table only if it is not."""
    for lo in (max(tab.disk - tail, 0), 0):
        rows = tab.read(lo)
        hit = np.nonzero(rows["step"] == step)[0]
        if hit.size:
            return rows[hit[-1]]
        if lo == 0:
            return None
    return None


class TensorBoardSink:
    """Event files under `<run_dir>/tensorboard` (torch's SummaryWriter)."""

    def __init__(self, run_dir: Path, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self.dir = Path(run_dir) / "tensorboard"
        # purge_step: TensorBoard hides events at or past it from earlier files (a resume)
        self.writer = SummaryWriter(str(self.dir), purge_step=first_step or None, flush_secs=30)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for tag, v in scalars.items():
            self.writer.add_scalar(tag, v, global_step=step)
        self.writer.flush()         # a step is seconds apart: people watch it live

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """An offline W&B run under `<run_dir>/wandb`; `wandb sync` uploads it afterwards."""

    def __init__(self, run_dir: Path, run_id: str, name: str, config: dict) -> None:
        os.environ.setdefault("WANDB_MODE", "offline")
        import wandb
        if os.environ["WANDB_MODE"] not in ("offline", "disabled"):
            raise RuntimeError(f"run.loggers: wandb runs offline on compute nodes (no internet), "
                               f"but WANDB_MODE={os.environ['WANDB_MODE']!r}; unset it")
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", x_disable_stats=True, disable_git=True,
                                  save_code=False, silent=True)
        self.run = wandb.init(mode=os.environ["WANDB_MODE"], dir=str(run_dir), id=run_id, name=name,
                              resume="allow", config=config, settings=settings, reinit="create_new")
        self.run.define_metric("global_step")
        self.run.define_metric("*", step_metric="global_step")

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({"global_step": step, **scalars})

    def close(self) -> None:
        self.run.finish()


class Sinks:
    """The sinks a run's config asks for; `write` fans one step out to each."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for s in self.sinks:
            s.write(step, scalars)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []          # idempotent: preemption and finish both close
        for s in sinks:
            s.close()


def open_sinks(cfg, store, first_step: int) -> Sinks:
    """The sinks of `cfg.run.loggers` for the run whose store is `store` (open for writing)."""
    from flexmarl_hpc.config.load import to_dict
    run_dir = Path(cfg.output_dir)
    sinks: list[Sink] = []
    for name in cfg.run.loggers:
        if name == "tensorboard":
            sinks.append(TensorBoardSink(run_dir, first_step))
        elif name == "wandb":
            # stable across resumes of this store, new for a fresh one; W&B ids allow [\w-]
            run_id = re.sub(r"[^\w-]", "-", f"{cfg.run.name}-{int(store.f.attrs['created'])}")
            sinks.append(WandbSink(run_dir, run_id, cfg.run.name, to_dict(cfg)))
    return Sinks(sinks)
