"""Typed run configuration: YAML -> dataclasses, dotted overrides, validation.

Each component owns a small dataclass; the attribute docstring under a field is its
help text (`python -m flexmarl_hpc.run --help-config` prints them). Everything here is
pure: loading and validation run on a login node before any rank starts.

    cfg = load_config("configs/local.yaml", ["trainer.lr=1e-4", "run.steps=50"])
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import os
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
    checkpoint_every: int = 0
    """Checkpoint every N steps (0: only at the end and on preemption)."""
    resume: bool = True
    """Resume from the latest checkpoint and the store in output_dir when one exists."""
    log_every: int = 1
    """Print one log line every N steps."""
    worker_timeout: float = 1800.0
    """Seconds a replica, trainer group or reward function may take to answer one command
    before it counts as hung: the job then reports it, checkpoints what still answers and
    exits 75 (requeue) instead of sitting until the wall-clock limit."""


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
    """PPO ratio clip."""
    entropy_coef: float = 0.0
    """Entropy bonus (the referential game needs ~0.05, see DESIGN.md)."""
    kl_coef: float = 0.0
    """KL penalty to the frozen initial policy (k3 estimator; 0: no reference model)."""
    tis_cap: float = 2.0
    """Truncation of the importance weight for stale samples (max_staleness > 0)."""


@dataclass
class PipelineConfig:
    max_staleness: int = 0
    """Most policy versions a trained sample may lag (0: strictly on-policy, equals sync)."""
    load_balance: bool = True
    """Level-1 (inter-agent replica binding) load balancing; off: replicas split evenly."""
    rebalance_threshold: float = 0.5
    """Re-bind replicas when the backlog share and replica share of an agent differ by more."""
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
    bucket_mb: float = 4.0
    """Bucket size of the trainer -> replica weight broadcast, in MiB."""


@dataclass
class StoreConfig:
    chunk_rows: int = 1024
    """HDF5 chunk length of the sample tables."""


@dataclass
class SlurmComponent:
    nodes: int = 1
    """Nodes of this het component."""
    gpus_per_node: int = 0
    """GPUs per node (`--gpus-per-node`)."""
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
        return self.trainer.groups or len(self.agent_names)

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
                          f"({getattr(e, 'problem', None) or e}); quote it in the shell") from None


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Read a YAML file (or defaults if None), apply overrides, validate."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{p}: config file not found")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: expected a mapping at the top level")
    for o in overrides:
        apply_override(data, o)
    cfg = from_dict(Config, data)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Checks that need more than one field. Raises ConfigError naming the field."""
    def need(cond: bool, where: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"{where}: {msg}")

    turns = cfg.workflow.turns
    need(len(turns) > 0, "workflow.turns", "expected at least one turn")
    for i, t in enumerate(turns):
        need(bool(t.agent), f"workflow.turns[{i}].agent", "expected an agent name")
        need(t.samples >= 1, f"workflow.turns[{i}].samples", f"expected >= 1, got {t.samples}")
        need(t.max_new_tokens >= 1, f"workflow.turns[{i}].max_new_tokens", "expected >= 1")
    need(":" in cfg.workflow.task, "workflow.task", f"expected 'module:Class', got {cfg.workflow.task!r}")
    need(cfg.workflow.inputs_per_step >= 1, "workflow.inputs_per_step", "expected >= 1")
    for name in cfg.agents:
        need(name in cfg.agent_names, f"agents.{name}",
             f"no such agent in workflow.turns (agents are {cfg.agent_names})")
    need(cfg.run.steps >= 1, "run.steps", "expected >= 1")
    need(cfg.rollout.replicas >= 1, "rollout.replicas", "expected >= 1 replica")
    need(0 < cfg.rollout.top_p <= 1, "rollout.top_p", "expected 0 < top_p <= 1")
    need(cfg.run.worker_timeout > 0, "run.worker_timeout", "expected seconds > 0")
    need(cfg.rollout.temperature > 0, "rollout.temperature", "expected > 0")
    need(cfg.rollout.max_model_len >= 0, "rollout.max_model_len", "expected >= 0 (0: the model's max_seq_len)")
    need(cfg.trainer.ranks_per_group >= 1, "trainer.ranks_per_group", "expected >= 1")
    mp = cfg.trainer.tensor_parallel * cfg.trainer.pipeline_parallel
    need(mp >= 1 and cfg.trainer.ranks_per_group % mp == 0, "trainer.ranks_per_group",
         f"expected a multiple of tensor_parallel x pipeline_parallel = {mp}, "
         f"got {cfg.trainer.ranks_per_group}")
    need(cfg.trainer.backend == "megatron" or mp == 1, "trainer.tensor_parallel",
         "tensor/pipeline parallelism needs trainer.backend=megatron")
    need(cfg.trainer.micro_batch_size >= 1, "trainer.micro_batch_size", "expected >= 1")
    need(cfg.trainer.groups >= 0, "trainer.groups", "expected >= 0 (0: one per agent)")
    n_agents = len(cfg.agent_names)
    if cfg.num_trainer_groups < n_agents and not cfg.pipeline.swap_states:
        orphan = cfg.agent_names[cfg.num_trainer_groups]
        raise ConfigError(
            f"trainer.groups: {cfg.num_trainer_groups} groups for {n_agents} agents leaves agent "
            f"{orphan!r} with no trainer; set trainer.groups=0 or pipeline.swap_states=true")
    need(cfg.num_trainer_groups <= n_agents, "trainer.groups",
         f"expected at most {n_agents} (one per agent), got {cfg.num_trainer_groups}")
    need(cfg.pipeline.max_staleness >= 0, "pipeline.max_staleness", "expected >= 0")
    need(cfg.pipeline.overprovision >= 0, "pipeline.overprovision", "expected >= 0 extra inputs per step")
    need(cfg.pipeline.overprovision == 0 or cfg.run.mode == "flex", "pipeline.overprovision",
         "needs run.mode=flex (sync, the baseline, trains every input it admits)")
    need(cfg.weight_sync.bucket_mb > 0, "weight_sync.bucket_mb", "expected > 0")
    for agent in cfg.agent_names:
        m = cfg.model_for(agent)
        where = f"agents.{agent}" if agent in cfg.agents else "model"
        need(m.hidden_size % m.num_heads == 0, f"{where}.num_heads",
             f"hidden_size {m.hidden_size} is not divisible by num_heads {m.num_heads}")
        need(m.num_heads % m.num_kv_heads == 0, f"{where}.num_kv_heads",
             f"num_heads {m.num_heads} is not divisible by num_kv_heads {m.num_kv_heads}")
        need((m.hidden_size // m.num_heads) % 2 == 0, f"{where}.hidden_size",
             "head dim (hidden_size / num_heads) must be even for RoPE")
        if m.checkpoint:
            need(Path(m.checkpoint).is_dir(), f"{where}.checkpoint",
                 f"expected a local HF checkpoint folder, {m.checkpoint!r} does not exist")


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
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  {key} = {to_dict(default)!r}\n      {docs.get(f.name, '')}")
    return "\n".join(lines)
