"""Typed run configuration: YAML -> dataclasses, dotted overrides, validation.

Each component owns a small dataclass; the attribute docstring under a field is its
help text (`python -m flexmarl_hpc.run --help-config` prints them). Everything here is
pure: loading and validation run on a login node before any rank starts.

    cfg = load_config("configs/local.yaml", ["trainer.lr=1e-4", "run.steps=50"])
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import math
import os
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config field or file is wrong; the message names it and what was expected."""


# ---------------------------------------------------------------------------------------
# Component configs
# ---------------------------------------------------------------------------------------
@dataclass
class RunConfig:
    name: str = "run"
    """Run name: used for the output folder, the HDF5 file and the Slurm job name."""
    output_dir: str = "runs/{name}"
    """Folder for the resolved config, the HDF5 store, checkpoints and logs ({name} expands)."""
    mode: Literal["sync", "flex"] = "flex"
    """`sync`: barrier baseline (roll out all, train all, sync all). `flex`: micro-batch pipeline."""
    steps: int = 100
    """Optimizer steps per agent."""
    seed: int = 0
    """Master seed: inputs, model init and per-sample sampling seeds derive from it."""
    threads_per_rank: int = 1
    """torch intra-op threads per MPI rank (ranks usually outnumber cores)."""
    idle_wait: Literal["doorbell", "poll"] = "doorbell"
    """How the orchestrator and its workers wait for each other's messages. `doorbell`: asleep
    in the kernel until the sender rings a TCP socket it shares with them (flexmarl_hpc.
    doorbell; no CPU while idle; falls back to `poll` if the sockets cannot be opened).
    `poll`: MPI probes with back-off sleeps (20 us .. 0.5 ms), each wake-up preempting a rank
    that computes on a node whose cores are full."""
    checkpoint_every: int = 10
    """Checkpoint every N steps (0: by minutes only; the end of the run and a preemption
    signal always checkpoint)."""
    checkpoint_minutes: float = 10.0
    """Also checkpoint an agent when this many minutes passed since its last checkpoint
    (0: by steps only). With both 0 a crash restarts from step 0."""
    keep_checkpoints: int = 3
    """Checkpoints kept per agent (older ones are deleted once a newer one is verified on disk);
    a corrupted newest checkpoint falls back to the one before."""
    resume: bool = True
    """Resume from the latest checkpoint and the store in output_dir when one exists."""
    log_every: int = 1
    """Print one log line every N steps."""
    loggers: list[Literal["tensorboard", "wandb"]] = field(default_factory=list)
    """Metric sinks besides the HDF5 store (optional extras, requirements-loggers.txt):
    `tensorboard` writes <output_dir>/tensorboard, `wandb` an offline run in <output_dir>/wandb."""
    worker_timeout: float = 1800.0
    """Seconds a replica, trainer group or reward function may take to answer one command
    before it counts as hung: the job then reports it, checkpoints what still answers and
    exits 75 (requeue) instead of sitting until the wall-clock limit."""
    eval_every: int = 0
    """Evaluate every agent on the task's held-out inputs (Task.heldout_inputs) every N
    optimizer steps, and before the first and after the last (0: never). It runs through the
    same workflow on the rollout replicas and is never trained on (results: /eval)."""
    eval_inputs: int = 32
    """Held-out root inputs per evaluation."""
    eval_samples: int = 0
    """0: greedy evaluation only (temperature 0, one response per turn). n > 0: also n
    sampled chains per input at rollout.temperature (mode `sample` in /eval, their mean)."""


@dataclass
class ModelConfig:
    """A Llama/Qwen2-family decoder; HF parameter names, so weights move between backends."""

    hidden_size: int = 64
    """Model width (HF `hidden_size`)."""
    num_layers: int = 2
    """Decoder layers (HF `num_hidden_layers`)."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 4
    """Key/value heads (GQA when < num_heads)."""
    intermediate_size: int = 128
    """SwiGLU hidden width."""
    max_seq_len: int = 64
    """Longest prompt + response, in tokens."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rms_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_embeddings: bool = True
    """Share the input embedding and the LM head."""
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2 style; Llama has none)."""
    init_std: float = 0.02
    """Std of the random init (ignored when `checkpoint` is set)."""
    checkpoint: str = ""
    """Local HF checkpoint folder (safetensors + config.json) to start from; empty: random init."""


@dataclass
class TurnConfig:
    agent: str = ""
    """Which agent acts at this turn."""
    samples: int = 1
    """Branches per prompt at this turn (the GRPO group size of this agent)."""
    max_new_tokens: int = 8
    """Longest response of this turn."""


@dataclass
class WorkflowConfig:
    task: str = "flexmarl_hpc.workflows.referential:ReferentialGame"
    """Python class implementing the task, as `module:Class` (see flexmarl_hpc/workflows/base.py)."""
    task_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the task class."""
    turns: list[TurnConfig] = field(default_factory=list)
    """The agents in workflow order; each turn branches every path of the previous turn."""
    inputs_per_step: int = 8
    """Root inputs (prompts) per step; an agent's global batch is this times its branching."""


@dataclass
class RolloutConfig:
    backend: Literal["torch", "vllm"] = "torch"
    """Inference engine of the replicas."""
    replicas: int = 1
    """Rollout replica ranks in the pool (any replica can serve any agent)."""
    max_batch: int = 256
    """Most sequences one replica decodes at once."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_model_len: int = 0
    """Longest prompt + response a replica serves (0: the model's max_seq_len). Bounds vLLM's
    KV cache: a pretrained model's context (8192 for SmolLM2) sized for max_batch sequences
    would not fit in host memory."""
    gpus_per_replica: int = 1
    """GPUs of one replica on GPU nodes (a contiguous block of its node's GPUs; vLLM's tensor
    parallelism stays inside it). Ignored on CPU nodes."""
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Weights/activations dtype of the vLLM engines. auto: bf16 on GPU, fp32 on CPU."""
    pools: list["RolloutPool"] = field(default_factory=list)
    """Rollout pools, each its own het-job component (flexmarl_hpc/config/resources.py). Empty: one
    pool of `replicas` x `gpus_per_replica` serving every agent, in slurm.rollout."""


@dataclass
class TrainerConfig:
    backend: Literal["torch", "megatron"] = "torch"
    """Training engine of the trainer groups."""
    groups: int = 0
    """Trainer groups (0: one per agent). Fewer than agents needs pipeline.swap_states."""
    ranks_per_group: int = 1
    """Ranks per trainer group = tensor_parallel x pipeline_parallel x data parallel."""
    tensor_parallel: int = 1
    """Tensor-parallel degree inside a group (megatron backend only)."""
    pipeline_parallel: int = 1
    """Pipeline-parallel degree inside a group (megatron backend only)."""
    named_groups: list["TrainerGroup"] = field(default_factory=list)
    """Trainer groups with their own shape and het-job component (flexmarl_hpc/config/resources.py).
    Empty: `groups` groups of `ranks_per_group` ranks in slurm.trainer."""
    lr: float = 1e-3
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0: off)."""
    micro_batch_size: int = 16
    """Samples per forward/backward; gradients accumulate up to the global batch."""
    clip_eps: float = 0.2
    """PPO ratio clip: r = pi/pi_old is bounded to [1 - clip_eps, 1 + clip_eps] for the
    advantage's sign. It acts only with ppo_epochs > 1 (one pass has r = 1)."""
    ppo_epochs: int = 1
    """Optimizer passes over each global batch (verl ppo_epochs, TRL num_iterations, GRPO's
    mu), one step each; pi_old is the trainer's policy before the batch's first pass. The
    replay runs inside the trainer group, so a step is still one policy version."""
    entropy_coef: float = 0.0
    """Entropy bonus (the referential game needs ~0.05, see DESIGN.md)."""
    kl_coef: float = 0.0
    """KL penalty to the frozen initial policy (k3 estimator; 0: no reference model)."""
    tis_cap: float = 2.0
    """Truncation of the per-token importance weight exp(logp_trainer - logp_rollout) that
    every sample gets (rollout correction: engine mismatch, and staleness when
    max_staleness > 0)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Training precision of the megatron backend: bf16 weights/activations (Float16Module)
    with fp32 main params and gradient reduction in the DistributedOptimizer, or fp32
    throughout. auto: bf16 on GPU, fp32 on CPU. The torch backend trains fp32."""
    recompute: Literal["none", "selective", "full"] = "none"
    """megatron activation recompute: selective (attention core) or full (every layer)."""
    overlap_grad_reduce: bool = False
    """megatron: overlap the data-parallel gradient reduce-scatter with the last micro-batch's
    backward (GPU)."""
    overlap_param_gather: bool = False
    """megatron: all-gather updated params asynchronously after the optimizer step (GPU); the
    group still completes the gather before it reads the weights for a sync."""
    pipeline_microbatches: int = 0
    """megatron: micro-batches the trainer's share of each runtime micro-batch is cut into
    for the 1F1B pipeline schedule (0: 2 x pipeline_parallel when PP > 1, else 1)."""


@dataclass
class PipelineConfig:
    max_staleness: int = 0
    """Most policy versions a trained sample may lag (0: strictly on-policy, equals sync)."""
    load_balance: bool = True
    """Level-1 (inter-agent replica binding) load balancing; off: replicas split evenly."""
    rebalance_threshold: float = 0.5
    """Re-bind replicas when the backlog share and replica share of an agent differ by more
    (scheduler.rebind without batch-boundary information; a flex run time-shares instead)."""
    rebalance_cooldown: int = 4
    """Scheduling rounds to wait between two re-bindings (hysteresis)."""
    micro_batch_overlap: bool = True
    """flex: train micro-batches as they fill (off: wait for the agent's whole batch; ablation)."""
    swap_states: bool = False
    """Allow fewer trainer groups than agents: states are swapped in and out on demand."""
    overprovision: int = 0
    """flex: extra inputs admitted per step beyond workflow.inputs_per_step. The first
    inputs_per_step inputs whose whole workflow tree finishes form the step's batch; the
    others are dropped (status `dropped` in the store, never trained), so a long-tailed
    input does not hold the step. 0: every input is trained, as in sync."""


@dataclass
class WeightSyncConfig:
    bucket_mb: float = 1024.0
    """Largest single collective of the trainer -> replica weight broadcast over a
    torch.distributed group (gloo/nccl; several in flight at once), in MiB. The whole model
    sits in one staging buffer anyway, and one large broadcast measured faster than 4 MiB
    buckets (gloo pipelines inside it, as NCCL does). The mpi backend sends one Bcast."""
    backend: Literal["auto", "mpi", "gloo", "nccl"] = "auto"
    """Transport of the weight broadcast: nccl (GPU to GPU, bf16-ready), gloo or mpi on CPU
    (the same code, weight_sync.py). auto: nccl where CUDA is available, else the CPU
    backend measured faster here (bench/bench_weight_sync.py)."""


@dataclass
class StoreConfig:
    chunk_rows: int = 256
    """HDF5 chunk length of the sample tables (the token pools: 8x). A flush writes each chunk it
    touches whole, so a chunk near one flush's rows is cheapest to write (256 x 178-byte rows:
    45 KiB); bench/bench_store.py measures it."""


@dataclass
class SlurmComponent:
    nodes: int = 1
    """Nodes of this het component."""
    gpus_per_node: int = 0
    """GPUs per node. Het rollout/trainer components: the job asks `--gpus-per-task` (one block
    per rank) and a node's tasks x GPUs must fit here; `--single`: `--gpus-per-node`."""
    cpus_per_task: int = 1
    """CPUs per rank."""
    mem: str = ""
    """Memory per node (`--mem`), e.g. 64G; empty: site default."""
    partition: str = ""
    """Partition of this component; empty: slurm.partition."""
    sbatch_options: list[str] = field(default_factory=list)
    """Extra `#SBATCH` options of this component, e.g. ['--constraint=a100', '--exclusive'];
    `--single` and sweeps take the trainer's."""


@dataclass
class RolloutPool:
    """Replicas of one size class, the agents they may serve, and their het-job component."""

    name: str = ""
    """Pool name (labels its component and the dry-run table); empty: pool<i>."""
    replicas: int = 1
    """Replica ranks in the pool."""
    gpus_per_replica: int = 1
    """GPUs of one replica rank (vLLM's tensor_parallel_size lives inside it)."""
    gpu_memory_gb: float = 0.0
    """Memory of one GPU, to check that each served model's weights fit a replica
    (0: not checked, e.g. CPU nodes)."""
    agents: list[str] = field(default_factory=list)
    """Agents the pool may serve; empty: every agent whose model fits its replicas."""
    slurm: SlurmComponent = field(default_factory=SlurmComponent)
    """This pool's het-job component (nodes, gpus_per_node, partition, sbatch_options)."""


@dataclass
class TrainerGroup:
    """The trainer ranks of some agents: their shape, backend and het-job component."""

    name: str = ""
    """Group name (labels its component and the dry-run table); empty: group<i>."""
    agents: list[str] = field(default_factory=list)
    """Agents trained on this group (the first starts resident; more than one needs
    pipeline.swap_states)."""
    ranks: int = 1
    """Ranks of the group = tensor_parallel x pipeline_parallel x data parallel."""
    tensor_parallel: int = 1
    """Tensor-parallel degree (megatron); must divide the heads of the group's models."""
    pipeline_parallel: int = 1
    """Pipeline-parallel degree (megatron); must divide the layers of the group's models."""
    backend: Literal["torch", "megatron"] = "torch"
    """Training engine of this group."""
    swap: str = ""
    """Swap domain: groups with the same non-empty label may take each other's agents
    (pipeline.swap_states); they must have the same shape. Empty: its agents stay here."""
    slurm: SlurmComponent = field(default_factory=SlurmComponent)
    """This group's het-job component (nodes, gpus_per_node, partition, sbatch_options)."""


@dataclass
class SlurmConfig:
    partition: str = ""
    """Default partition of all components."""
    account: str = ""
    """`--account`."""
    qos: str = ""
    """`--qos`."""
    time: str = "01:00:00"
    """Time limit (`--time`)."""
    mpi: str = "pmi2"
    """`srun --mpi=` plugin (pmi2 or pmix)."""
    signal_seconds: int = 120
    """Seconds before the time limit at which SIGUSR1 asks the job to checkpoint and requeue."""
    requeue: bool = True
    """Requeue on preemption/time limit and resume."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before srun (module loads, venv activation, NCCL/UCX env)."""
    sbatch_options: list[str] = field(default_factory=list)
    """Extra job-wide `#SBATCH` options, e.g. ['--mail-type=END', '--reservation=res1']."""
    orchestrator: SlurmComponent = field(default_factory=SlurmComponent)
    """Het component 0: the orchestrator rank."""
    rollout: SlurmComponent = field(default_factory=SlurmComponent)
    """Het component 1: the rollout pool."""
    trainer: SlurmComponent = field(default_factory=SlurmComponent)
    """Het component 2: the trainer groups."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    """Default model of every agent."""
    agents: dict[str, ModelConfig] = field(default_factory=dict)
    """Per-agent model overrides (keys are agent names); missing agents use `model`."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    # -- derived views (pure) ----------------------------------------------------------
    @property
    def agent_names(self) -> list[str]:
        """Agents in order of first appearance in the workflow."""
        return list(dict.fromkeys(t.agent for t in self.workflow.turns))

    def model_for(self, agent: str) -> ModelConfig:
        return self.agents.get(agent, self.model)

    @property
    def num_trainer_groups(self) -> int:
        return len(self.trainer.named_groups) or self.trainer.groups or len(self.agent_names)

    @property
    def output_dir(self) -> Path:
        return Path(self.run.output_dir.format(name=self.run.name))


# ---------------------------------------------------------------------------------------
# Generic dataclass <-> dict conversion with field-named errors
# ---------------------------------------------------------------------------------------
def from_dict(cls: type, data: Any, where: str = "") -> Any:
    """Build dataclass `cls` from plain data, naming the bad field on any error."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"{_join(where, unknown[0])}: unknown key; expected one of {sorted(names)}")
    kwargs = {k: _convert(hints[k], v, _join(where, k)) for k, v in data.items()}
    return cls(**kwargs)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: expected one of {list(args)}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {k: _convert(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:                       # YAML 1.1 reads `1e-4` (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp is str and isinstance(value, int) and not isinstance(value, bool):
        return str(value)          # YAML reads `time: 90` or `name: 42` as a number
    if tp in (int, float, str, bool):
        if type(value) is not tp:
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp}")


def to_dict(obj: Any) -> Any:
    """Plain data (YAML/JSON-safe) of a config."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


# ---------------------------------------------------------------------------------------
# Loading, overrides, validation
# ---------------------------------------------------------------------------------------
def apply_override(data: dict, override: str) -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected key.path=value")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {p} is not a section")
    # `key=` means the empty string (e.g. `model.checkpoint=` for random init), not YAML's null
    try:
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key.strip()}: the value {raw!r} is not valid YAML "
                          f"({_one_line(e)}); quote it in the shell") from None


def _one_line(e: Exception) -> str:
    """A YAML error's problem and position on one line (its str() spans several)."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Read a YAML file (or defaults if None), apply overrides, validate."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{p}: config file not found")
        try:
            data = yaml.safe_load(p.read_bytes().decode("utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: expected UTF-8 text, byte {e.object[e.start]:#04x} at offset "
                              f"{e.start} is not ({e.reason})") from None
        except OSError as e:
            raise ConfigError(f"{p}: cannot read the config file ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {_one_line(e)}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: expected a mapping at the top level")
    for o in overrides:
        apply_override(data, o)
    cfg = from_dict(Config, data)
    validate(cfg)
    return cfg


# Field ranges (run.py adds the checks that need the task or the machine: sequence lengths,
# the number of ranks a local run may start)
MAX_STEPS = 10**9
"""run.steps above this cannot be meant (and step numbers must fit the store's int64)."""
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")
"""Agent names become HDF5 group and checkpoint folder names."""


def _need(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{where}: {msg}")


def _int_in(value: int, where: str, lo: int, hi: int | None = None, note: str = "") -> None:
    ok = value >= lo and (hi is None or value <= hi)
    rng = f">= {lo}" if hi is None else f"{lo}..{hi}"
    _need(ok, where, f"expected {rng}{note}, got {value}")


def _float_in(value: float, where: str, lo: float, hi: float | None = None, lo_open: bool = False,
              hi_open: bool = False) -> None:
    ok = (value > lo if lo_open else value >= lo) and (
        hi is None or (value < hi if hi_open else value <= hi))
    rng = f"{'>' if lo_open else '>='} {lo:g}" if hi is None else \
        f"{lo:g} {'<' if lo_open else '<='} x {'<' if hi_open else '<='} {hi:g}"
    _need(ok, where, f"expected {rng}, got {value!r}")


def check_leaves(obj: Any, where: str = "") -> None:
    """Every float is finite and no string (nor mapping key) holds a control character: strings
    reach file names, HDF5 attributes and the sbatch script, where a newline splits a line."""
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            check_leaves(getattr(obj, f.name), _join(where, f.name))
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
        bad = next((c for c in obj if ord(c) < 32 or ord(c) == 127), None)
        _need(bad is None, where, f"control character {bad!r} in {obj!r}; expected printable text "
                                  "(it would reach file names and the sbatch script)")


def _validate_run(r: RunConfig) -> None:
    _need(bool(r.name) and "/" not in r.name and r.name not in (".", ".."), "run.name",
          f"expected a non-empty name without '/', got {r.name!r}")
    _need(bool(r.output_dir), "run.output_dir", "expected a folder")
    try:
        r.output_dir.format(name=r.name)
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        raise ConfigError(f"run.output_dir: only {{name}} may appear in braces (double them for a "
                          f"literal brace), got {r.output_dir!r} ({type(e).__name__}: {e})") from None
    _int_in(r.steps, "run.steps", 1, MAX_STEPS)
    _int_in(r.seed, "run.seed", 0, 2**63 - 1)
    _int_in(r.threads_per_rank, "run.threads_per_rank", 1, 1024)
    _int_in(r.checkpoint_every, "run.checkpoint_every", 0, note=" (0: by minutes only)")
    _float_in(r.checkpoint_minutes, "run.checkpoint_minutes", 0)
    _float_in(r.worker_timeout, "run.worker_timeout", 0, lo_open=True)
    _int_in(r.keep_checkpoints, "run.keep_checkpoints", 1)
    _int_in(r.log_every, "run.log_every", 1)
    _int_in(r.eval_every, "run.eval_every", 0, MAX_STEPS, note=" (0: no evaluation)")
    _int_in(r.eval_inputs, "run.eval_inputs", 1, 1 << 20)
    _int_in(r.eval_samples, "run.eval_samples", 0, 1024, note=" (0: greedy only)")


def _validate_model(m: ModelConfig, where: str) -> None:
    for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
        _int_in(getattr(m, key), f"{where}.{key}", 1)
    _int_in(m.max_seq_len, f"{where}.max_seq_len", 2)
    _float_in(m.rope_theta, f"{where}.rope_theta", 1, lo_open=True)
    _float_in(m.rms_eps, f"{where}.rms_eps", 0, 1, lo_open=True)
    _float_in(m.init_std, f"{where}.init_std", 0, lo_open=True)
    _need(m.hidden_size % m.num_heads == 0, f"{where}.num_heads",
          f"hidden_size {m.hidden_size} is not divisible by num_heads {m.num_heads}")
    _need(m.num_heads % m.num_kv_heads == 0, f"{where}.num_kv_heads",
          f"num_heads {m.num_heads} is not divisible by num_kv_heads {m.num_kv_heads}")
    _need((m.hidden_size // m.num_heads) % 2 == 0, f"{where}.hidden_size",
          "head dim (hidden_size / num_heads) must be even for RoPE")
    if m.checkpoint:
        _need(Path(m.checkpoint).is_dir(), f"{where}.checkpoint",
              f"expected a local HF checkpoint folder, {m.checkpoint!r} does not exist")


def _validate_workflow(w: WorkflowConfig) -> None:
    _need(len(w.turns) > 0, "workflow.turns", "expected at least one turn")
    for i, t in enumerate(w.turns):
        _need(bool(NAME_RE.match(t.agent)), f"workflow.turns[{i}].agent",
              f"expected an agent name of letters, digits, _ . + - (it names HDF5 groups and "
              f"checkpoint folders), got {t.agent!r}")
        _int_in(t.samples, f"workflow.turns[{i}].samples", 1)
        _int_in(t.max_new_tokens, f"workflow.turns[{i}].max_new_tokens", 1)
    _need(":" in w.task, "workflow.task", f"expected 'module:Class', got {w.task!r}")
    _int_in(w.inputs_per_step, "workflow.inputs_per_step", 1)


def _validate_engines(cfg: Config) -> None:
    ro, tr, p = cfg.rollout, cfg.trainer, cfg.pipeline
    _int_in(ro.replicas, "rollout.replicas", 1, note=" replica")
    _int_in(ro.max_batch, "rollout.max_batch", 1)
    _float_in(ro.temperature, "rollout.temperature", 0, lo_open=True)
    _float_in(ro.top_p, "rollout.top_p", 0, 1, lo_open=True)
    _int_in(ro.max_model_len, "rollout.max_model_len", 0, note=" (0: the model's max_seq_len)")
    _int_in(tr.groups, "trainer.groups", 0, note=" (0: one per agent)")
    for key in ("ranks_per_group", "tensor_parallel", "pipeline_parallel", "micro_batch_size"):
        _int_in(getattr(tr, key), f"trainer.{key}", 1)
    _float_in(tr.lr, "trainer.lr", 0, lo_open=True)
    for i, b in enumerate(tr.betas):
        _float_in(b, f"trainer.betas[{i}]", 0, 1, hi_open=True)
    for key in ("weight_decay", "grad_clip", "entropy_coef", "kl_coef"):
        _float_in(getattr(tr, key), f"trainer.{key}", 0)
    _float_in(tr.clip_eps, "trainer.clip_eps", 0, lo_open=True)
    _int_in(tr.ppo_epochs, "trainer.ppo_epochs", 1, 16)
    _float_in(tr.tis_cap, "trainer.tis_cap", 0, lo_open=True)
    _int_in(p.max_staleness, "pipeline.max_staleness", 0)
    _float_in(p.rebalance_threshold, "pipeline.rebalance_threshold", 0, 1)
    _int_in(p.rebalance_cooldown, "pipeline.rebalance_cooldown", 0)
    _int_in(p.overprovision, "pipeline.overprovision", 0, note=" extra inputs per step")
    _float_in(cfg.weight_sync.bucket_mb, "weight_sync.bucket_mb", 0, 16384, lo_open=True)
    _int_in(cfg.store.chunk_rows, "store.chunk_rows", 1, 1 << 20)
    s = cfg.slurm
    _int_in(s.signal_seconds, "slurm.signal_seconds", 0)
    for name in ("orchestrator", "rollout", "trainer"):
        comp = getattr(s, name)
        _int_in(comp.nodes, f"slurm.{name}.nodes", 1)
        _int_in(comp.gpus_per_node, f"slurm.{name}.gpus_per_node", 0)
        _int_in(comp.cpus_per_task, f"slurm.{name}.cpus_per_task", 1)


def validate(cfg: Config) -> None:
    """Every field's range, then checks that need more than one field. Raises ConfigError
    naming the field and what was expected; runs before any rank starts."""
    need = _need
    check_leaves(cfg)
    _validate_run(cfg.run)
    _validate_workflow(cfg.workflow)
    _validate_engines(cfg)
    for name in cfg.agents:
        need(name in cfg.agent_names, f"agents.{name}",
             f"no such agent in workflow.turns (agents are {cfg.agent_names})")
    for agent in cfg.agent_names:
        where = f"agents.{agent}" if agent in cfg.agents else "model"
        _validate_model(cfg.model_for(agent), where)
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

    # --- device binding (flexmarl_hpc.runtime.devices) ---
    need(cfg.rollout.gpus_per_replica >= 1, "rollout.gpus_per_replica", "expected >= 1")

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
    from flexmarl_hpc.config.resources import validate_resources     # pools and trainer groups (their own module)
    validate_resources(cfg)


# -- trainer engine fields (megatron precision, overlap, pipeline schedule) ------------------
def _validate_trainer_engine(t: "TrainerConfig", need) -> None:
    need(t.tis_cap > 0, "trainer.tis_cap", f"expected > 0, got {t.tis_cap}")
    need(t.pipeline_microbatches >= 0, "trainer.pipeline_microbatches",
         f"expected >= 0 (0: 2 x pipeline_parallel), got {t.pipeline_microbatches}")
    megatron_only = {"precision": t.precision in ("auto", "fp32"), "recompute": t.recompute == "none",
                     "overlap_grad_reduce": not t.overlap_grad_reduce,
                     "overlap_param_gather": not t.overlap_param_gather,
                     "pipeline_microbatches": t.pipeline_microbatches == 0}
    # with trainer.named_groups each group has its own backend: the options apply to the
    # megatron groups, so one is enough (checking the global backend refused them there)
    backends = {g.backend for g in t.named_groups} or {t.backend}
    for name, default in megatron_only.items():
        need("megatron" in backends or default, f"trainer.{name}",
             "needs a megatron trainer: trainer.backend=megatron, or a trainer.named_groups entry "
             "with backend megatron (the option applies to those groups)")


def save_config(cfg: Config, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


# ---------------------------------------------------------------------------------------
# Help text from attribute docstrings
# ---------------------------------------------------------------------------------------
def field_docs(cls: type) -> dict[str, str]:
    """{field: docstring} from the string literal that follows each field in the source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def help_text(cls: type = Config, prefix: str = "") -> str:
    lines = []
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = _join(prefix, f.name)
        if dataclasses.is_dataclass(tp):
            lines.append(help_text(tp, key))
            continue
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if dataclasses.is_dataclass(item):          # rollout.pools, trainer.named_groups
            lines.append(f"  {key} = []\n      {docs.get(f.name, '')}\n" + help_text(item, f"{key}[i]"))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  {key} = {to_dict(default)!r}\n      {docs.get(f.name, '')}")
    return "\n".join(lines)
