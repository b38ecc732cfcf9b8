"""Typed run configuration: one small dataclass per component, nothing else.

    from flexmarl_hpc.config.schema import Config, TrainerConfig
    cfg = Config()                       # every default; load.load_config reads YAML into it

The attribute docstring under a field is its help text (`python -m flexmarl_hpc.run
--help-config` prints them, config/load.py: help_text); a numeric field's bounds are on the
field (`bounded(default, ge=...)`, config/bounds.py), read by the help and by validation.
Loading lives in config/load.py, every check of a config in config/validate.py; this module imports neither.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from flexmarl_hpc.config.bounds import MAX_STARTUP_S, MAX_STEPS, SIGNAL_MAX_S, bounded
from flexmarl_hpc.config.errors import ConfigError
from flexmarl_hpc.config.tools import ToolsConfig


def join(where: str, key: str) -> str:
    """The dotted path of `key` under `where` (`trainer` + `lr` -> `trainer.lr`), for messages."""
    return f"{where}.{key}" if where else key


# ---------------------------------------------------------------------------------------
# Component configs
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    """Run name: used for the output folder, the HDF5 file and the Slurm job name."""
    output_dir: str = "runs/{name}"
    """Folder for the resolved config, the HDF5 store, checkpoints and logs ({name} expands)."""
    mode: Literal["sync", "flex"] = "flex"
    """`sync`: barrier baseline (roll out all, train all, sync all). `flex`: micro-batch pipeline."""
    steps: int = bounded(100, ge=1, le=MAX_STEPS)
    """Optimizer steps per agent."""
    seed: int = bounded(0, ge=0, le=2**63 - 1)
    """Master seed: inputs, model init and per-sample sampling seeds derive from it."""
    threads_per_rank: int = bounded(1, ge=1, le=1024)
    """torch intra-op threads per MPI rank (ranks usually outnumber cores)."""
    idle_wait: Literal["doorbell", "poll"] = "doorbell"
    """How the orchestrator and its workers wait for each other's messages. `doorbell`: asleep
    in the kernel until the sender rings a TCP socket it shares with them (runtime/doorbell.py; no CPU while idle; falls back to `poll` if the sockets cannot be opened).
    `poll`: MPI probes with back-off sleeps (20 us .. 0.5 ms), each wake-up preempting a rank
    that computes on a node whose cores are full."""
    checkpoint_every: int = bounded(10, ge=0, note=" (0: by minutes only)")
    """Checkpoint every N steps (0: by minutes only; the end of the run and a preemption
    signal always checkpoint)."""
    checkpoint_minutes: float = bounded(10.0, ge=0)
    """Also checkpoint an agent when this many minutes passed since its last checkpoint
    (0: by steps only). With both 0 a crash restarts from step 0."""
    keep_checkpoints: int = bounded(3, ge=1)
    """Checkpoints kept per agent (older ones are deleted once a newer one is verified on disk);
    a corrupted newest checkpoint falls back to the one before."""
    resume: bool = True
    """Resume from the latest checkpoint and the store in output_dir when one exists."""
    log_every: int = bounded(1, ge=1)
    """Print one log line every N steps."""
    loggers: list[Literal["tensorboard", "wandb"]] = field(default_factory=list)
    """Metric sinks besides the HDF5 store (optional extras, requirements-loggers.txt):
    `tensorboard` writes <output_dir>/tensorboard, `wandb` an offline run in <output_dir>/wandb."""
    worker_timeout: float = bounded(1800.0, gt=0)
    """Seconds a replica, trainer group or reward function may take to answer one command
    before it counts as hung: the job then reports it, checkpoints what still answers and
    exits 75 (requeue) instead of sitting until the wall-clock limit."""
    build_timeout_s: float = bounded(3600.0, gt=0, le=MAX_STARTUP_S)
    """Most seconds from a rank's start until every rank has built its engine or trainer
    (vLLM: load, compile, CUDA graphs; megatron: its shard's reads), 0 < x <= 86400. Past it
    the job ends (exit 1) naming this field; train.log reports each run's slowest build."""
    comm_setup_timeout_s: float = bounded(1800.0, gt=0, le=MAX_STARTUP_S)
    """Most seconds, once every rank is built, to set up every weight-sync communicator
    (one per trainer group and pool, made in order, config/sync_groups.py), 0 < x <= 86400.
    Past it the job ends (exit 1) naming this field; train.log reports the set-up's time."""
    eval_every: int = bounded(0, ge=0, le=MAX_STEPS, note=" (0: no evaluation)")
    """Evaluate every agent on the task's held-out inputs (Task.heldout_inputs) every N
    optimizer steps, and before the first and after the last (0: never). It runs through the
    same workflow on the rollout replicas and is never trained on (results: /eval)."""
    eval_inputs: int = bounded(32, ge=1, le=1 << 20)
    """Held-out root inputs per evaluation."""
    eval_samples: int = bounded(0, ge=0, le=1024, note=" (0: greedy only)")
    """0: greedy evaluation only (temperature 0, one response per turn). n > 0: also n
    sampled chains per input at rollout.temperature (mode `sample` in /eval, their mean)."""


@dataclass(frozen=True)
class ModelConfig:
    """A Llama/Qwen2-family decoder; HF parameter names, so weights move between backends."""

    hidden_size: int = bounded(64, ge=1)
    """Model width (HF `hidden_size`)."""
    num_layers: int = bounded(2, ge=1)
    """Decoder layers (HF `num_hidden_layers`)."""
    num_heads: int = bounded(4, ge=1)
    """Attention heads."""
    num_kv_heads: int = bounded(4, ge=1)
    """Key/value heads (GQA when < num_heads)."""
    intermediate_size: int = bounded(128, ge=1)
    """SwiGLU hidden width."""
    max_seq_len: int = bounded(64, ge=2)
    """Longest prompt + response, in tokens."""
    rope_theta: float = bounded(10000.0, gt=1)
    """RoPE base."""
    rms_eps: float = bounded(1e-6, gt=0, le=1)
    """RMSNorm epsilon."""
    tie_embeddings: bool = True
    """Share the input embedding and the LM head."""
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2 style; Llama has none)."""
    init_std: float = bounded(0.02, gt=0)
    """Std of the random init (ignored when `checkpoint` is set)."""
    checkpoint: str = ""
    """Local HF checkpoint folder (safetensors + config.json) to start from; empty: random init.
    Its config.json sets the shape fields above (leave them out; one set that disagrees is
    refused), config/checkpoint.py."""


@dataclass(frozen=True)
class TurnConfig:
    agent: str = ""
    """Which agent acts at this turn."""
    samples: int = bounded(1, ge=1)
    """Branches per prompt at this turn (the GRPO group size of this agent)."""
    max_new_tokens: int = bounded(8, ge=1)
    """Longest response of this turn."""


DATASET_WHERE = "workflow.dataset"
TOOL_CALL_FORMATS = ("hermes",)
"""The tool-call formats workflows/toolcalls.py parses (workflow.tool_formats)."""
AGENT_EPISODE = "flexmarl_hpc.workflows.openai_agent:episode"
"""workflow.episode when workflow.agent is set: the adapter that serves an `openai` program."""



class DatasetError(ConfigError):
    """A dataset field or file is wrong; the message names the field or the file and row, and
    what was expected (a ConfigError: `run` exits 2 on it before any rank starts)."""


@dataclass(frozen=True)
class DatasetConfig:
    train: str = ""
    """The training examples: a .jsonl file (one JSON object per line), a .parquet file, or a
    folder saved by HF datasets' `save_to_disk` (one split). Relative paths are from the
    working directory of the run."""
    eval: str = ""
    """The held-out examples, same formats ("": none). Evaluation takes the first
    run.eval_inputs of them in file order, never shuffled and never trained on."""
    fields: dict[str, str] = field(default_factory=dict)
    """Map from the key the episode reads to the column name in the file, e.g.
    {question: problem, answer: solution}. A key not listed is read from the column of the
    same name."""
    shuffle: bool = True
    """Shuffle the training examples, a new permutation each epoch drawn from
    (run.seed, epoch); off: file order every epoch."""

    def __post_init__(self) -> None:
        for name in ("train", "eval"):
            if not isinstance(getattr(self, name), str):
                raise DatasetError(f"{DATASET_WHERE}.{name}: expected a path (string), got {getattr(self, name)!r}")
        if not isinstance(self.fields, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and k and v for k, v in self.fields.items()):
            raise DatasetError(f"{DATASET_WHERE}.fields: expected a map of non-empty names (episode key -> "
                               f"column), got {self.fields!r}")
        if not isinstance(self.shuffle, bool):
            raise DatasetError(f"{DATASET_WHERE}.shuffle: expected true or false, got {self.shuffle!r}")


@dataclass(frozen=True)
class WorkflowConfig:
    task: str = "flexmarl_hpc.workflows.referential:ReferentialGame"
    """Python class implementing the task, as `module:Class` (see flexmarl_hpc/workflows/base.py)."""
    task_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the task class."""
    turns: list[TurnConfig] = field(default_factory=list)
    """The agents in workflow order; each turn branches every path of the previous turn."""
    inputs_per_step: int = bounded(8, ge=1)
    """Root inputs (prompts) per step; an agent's global batch is this times its branching.
    Episode workflows: dataset examples per step."""
    episode: str = ""
    """An episode function, `module:function` (`async def episode(ctx, example)`,
    docs/episodes.md); set, it replaces `task` and `turns`."""
    episode_args: dict[str, Any] = field(default_factory=dict)
    """Episode workflows: given to the episode function as `ctx.args`."""
    agents: list[str] = field(default_factory=list)
    """Episode workflows: the agents the episode function calls (each is trained)."""
    group_size: int = bounded(4, ge=1, le=1 << 16)
    """Episode workflows: episodes per example; GRPO compares a call with the same agent's
    same call in the example's other episodes."""
    max_new_tokens: int = bounded(256, ge=1, le=1 << 20)
    """Episode workflows: most tokens of one chat reply (ctx.chat's max_tokens cap)."""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """Episode workflows: the examples (workflows/dataset.py)."""
    on_error: Literal["drop", "zero"] = "drop"
    """Episode workflows: the calls of an episode that raised (or returned no usable reward).
    drop: never trained (status `dropped` in the store); zero: trained with reward 0 beside the
    example's other episodes. Either way the error is stored in /failures and logged."""
    tool_formats: dict[str, str] = field(default_factory=dict)
    """Episode workflows: {agent: format} of the tool calls its model writes (ctx.chat with
    tools=; one of TOOL_CALL_FORMATS, parsed by workflows/toolcalls.py); an agent not listed:
    hermes (Qwen2.5, Hermes)."""
    max_failure_rate: float = bounded(0.5, ge=0, le=1)
    """Episode workflows: the run stops (exit 1, checkpointed, store flushed) at the first step
    in which more than this share of episodes failed (0: any failure stops it; 1: never)."""
    agent: str = ""
    """A program written against the `openai` client, `module:function` taking
    `(base_url, example)` (sync or async; docs/episodes.md#agents-written-against-openai).
    Set, each episode serves it an OpenAI-compatible endpoint whose models are
    workflow.agents, and workflow.episode is the built-in adapter that runs it."""
    reward: str = ""
    """With workflow.agent: a reward function `module:function` taking (example, the
    program's return value, transcript) and returning {agent: reward}; empty: the program
    returns {agent: reward} itself."""
    agent_timeout_s: float = bounded(600.0, ge=1, le=86400)
    """With workflow.agent: most seconds one episode's program (and its reward function)
    may run, 1 .. 86400; past it the worker is killed and the episode fails (AgentTimeout)."""

    def __post_init__(self) -> None:
        # the adapter is an ordinary episode function: every `if workflow.episode` path serves it
        if self.agent and not self.episode:
            object.__setattr__(self, "episode", AGENT_EPISODE)          # frozen: set once, at build


@dataclass(frozen=True)
class RolloutConfig:
    backend: Literal["torch", "vllm"] = "torch"
    """Inference engine of the replicas."""
    replicas: int = bounded(1, ge=1, note=" replica")
    """Rollout replica ranks in the pool (any replica can serve any agent)."""
    max_batch: int = bounded(256, ge=1)
    """Most sequences one replica decodes at once."""
    temperature: float = bounded(1.0, gt=0)
    """Sampling temperature."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    max_model_len: int = bounded(0, ge=0, note=" (0: the model's max_seq_len)")
    """Longest prompt + response a replica serves (0: the model's max_seq_len). Bounds vLLM's
    KV cache: a pretrained model's context (8192 for SmolLM2) sized for max_batch sequences
    would not fit in host memory."""
    gpus_per_replica: int = bounded(1, ge=1)
    """GPUs of one replica on GPU nodes (a contiguous block of its node's GPUs; vLLM's tensor
    parallelism stays inside it). Ignored on CPU nodes."""
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Weights/activations dtype of the vLLM engines. auto: bf16 on GPU, fp32 on CPU."""
    pools: list["RolloutPool"] = field(default_factory=list)
    """Rollout pools, each its own het-job component (flexmarl_hpc/config/resources.py). Empty: one
    pool of `replicas` x `gpus_per_replica` serving every agent, in slurm.rollout."""


@dataclass(frozen=True)
class TrainerConfig:
    backend: Literal["torch", "megatron"] = "torch"
    """Training engine of the trainer groups."""
    groups: int = bounded(0, ge=0, note=" (0: one per agent)")
    """Trainer groups (0: one per agent). Fewer than agents needs pipeline.swap_states."""
    ranks_per_group: int = bounded(1, ge=1)
    """Ranks per trainer group = tensor_parallel x pipeline_parallel x data parallel."""
    tensor_parallel: int = bounded(1, ge=1)
    """Tensor-parallel degree inside a group (megatron backend only)."""
    pipeline_parallel: int = bounded(1, ge=1)
    """Pipeline-parallel degree inside a group (megatron backend only)."""
    named_groups: list["TrainerGroup"] = field(default_factory=list)
    """Trainer groups with their own shape and het-job component (flexmarl_hpc/config/resources.py).
    Empty: `groups` groups of `ranks_per_group` ranks in slurm.trainer."""
    lr: float = bounded(1e-3, gt=0)
    """AdamW learning rate."""
    betas: tuple[float, float] = bounded((0.9, 0.999), ge=0, lt=1)
    """AdamW betas."""
    weight_decay: float = bounded(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = bounded(1.0, ge=0)
    """Global gradient-norm clip (0: off)."""
    micro_batch_size: int = bounded(16, ge=1)
    """Samples per forward/backward; gradients accumulate up to the global batch."""
    clip_eps: float = bounded(0.2, gt=0)
    """PPO ratio clip: r = pi/pi_old is bounded to [1 - clip_eps, 1 + clip_eps] for the
    advantage's sign. It acts only with ppo_epochs > 1 (one pass has r = 1)."""
    ppo_epochs: int = bounded(1, ge=1, le=16)
    """Optimizer passes over each global batch (verl ppo_epochs, TRL num_iterations, GRPO's
    mu), one step each; pi_old is the trainer's policy before the batch's first pass. The
    replay runs inside the trainer group, so a step is still one policy version."""
    entropy_coef: float = bounded(0.0, ge=0)
    """Entropy bonus (the referential game needs ~0.05: docs/architecture.md "The entropy bonus")."""
    kl_coef: float = bounded(0.0, ge=0)
    """KL penalty to the frozen initial policy (k3 estimator; 0: no reference model)."""
    tis_cap: float = bounded(2.0, gt=0)
    """Truncation of the per-token importance weight exp(logp_trainer - logp_rollout) that
    every sample gets (rollout correction: engine mismatch, and staleness when
    max_staleness > 0)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Training precision of the megatron backend: bf16 weights/activations (Float16Module)
    with fp32 main params and gradient reduction in the DistributedOptimizer, or fp32
    throughout. auto: bf16 on GPU, fp32 on CPU. The torch backend trains fp32."""
    recompute: Literal["none", "selective", "full"] = "none"
    """megatron activation recompute, for long sequences: selective recomputes the core
    attention (its seq x seq scores) in backward; full keeps only each layer's input and
    recomputes the layer (recompute_method, recompute_num_layers); none keeps everything."""
    recompute_method: Literal["uniform", "block"] = "uniform"
    """recompute=full: uniform splits each pipeline stage's layers into chunks of
    recompute_num_layers and keeps one input per chunk; block recomputes only the first
    recompute_num_layers layers of each stage (the others keep their activations)."""
    recompute_num_layers: int = bounded(1, ge=1)
    """recompute=full: layers per chunk (uniform) or layers recomputed per stage (block); at
    least 1 and at most the layers of a pipeline stage."""
    overlap_grad_reduce: bool = False
    """megatron: overlap the data-parallel gradient reduce-scatter with the last micro-batch's
    backward (GPU)."""
    overlap_param_gather: bool = False
    """megatron: all-gather updated params asynchronously after the optimizer step (GPU); the
    group still completes the gather before it reads the weights for a sync."""
    pipeline_microbatches: int = bounded(0, ge=0, note=" (0: 2 x pipeline_parallel)")
    """megatron: micro-batches the trainer's share of each runtime micro-batch is cut into
    for the 1F1B pipeline schedule (0: 2 x pipeline_parallel when PP > 1, else 1)."""
    collective_timeout_s: float = bounded(1800.0, gt=0)
    """megatron: seconds the trainer group's torch.distributed world waits, at its start for
    every rank of the group to join its store, then on each of its collectives (TP, PP, DP).
    Past it NCCL's watchdog ends the rank (the job then exits 75, reliability.md) instead of
    hanging; it must exceed the slowest collective of a step, the optimizer step's included."""


@dataclass(frozen=True)
class PipelineConfig:
    max_staleness: int = bounded(0, ge=0)
    """Most policy versions a trained sample may lag (0: strictly on-policy, equals sync)."""
    load_balance: bool = True
    """Level-1 (inter-agent replica binding) load balancing; off: replicas split evenly."""
    rebalance_threshold: float = bounded(0.5, ge=0, le=1)
    """Re-bind replicas when the backlog share and replica share of an agent differ by more
    (scheduler.rebind without batch-boundary information; a flex run time-shares instead)."""
    rebalance_cooldown: int = bounded(4, ge=0)
    """Scheduling rounds to wait between two re-bindings (hysteresis)."""
    micro_batch_overlap: bool = True
    """flex: train micro-batches as they fill (off: wait for the agent's whole batch; ablation)."""
    swap_states: bool = False
    """Allow fewer trainer groups than agents: states are swapped in and out on demand."""
    one_agent_at_a_time: bool = False
    """Every replica of a pool serves one agent at a time, switching (a weight load) only when
    that agent has no request pending or in flight and the replicas are idle: time-shared,
    sequential agents (the MAS-RL baseline of sim/baselines.py)."""
    overprovision: int = bounded(0, ge=0, note=" extra inputs per step")
    """flex: extra inputs admitted per step beyond workflow.inputs_per_step. The first
    inputs_per_step inputs whose whole workflow tree finishes form the step's batch; the
    others are dropped (status `dropped` in the store, never trained), so a long-tailed
    input does not hold the step. 0: every input is trained, as in sync."""


@dataclass(frozen=True)
class WeightSyncConfig:
    bucket_mb: float = bounded(1024.0, gt=0, le=16384)
    """Bucket of the streamed trainer -> replica weight sync, in MiB: each PP stage's sender
    packs its tensors into buckets of this size (a larger tensor goes in pieces of whole
    rows, a bucket each) and holds two (one in flight while the next fills), each receiver
    (a vLLM TP worker on GPUs) one, grown to the largest tensor sent in pieces (its pieces
    land in place); it is also taken off vLLM's GPU memory fraction. Memory on both sides is
    bounded by it and the largest tensor, never by the model. At least one row of every
    tensor (hidden_size or intermediate_size elements) must fit."""
    backend: Literal["auto", "mpi", "gloo", "nccl"] = "auto"
    """Transport of the weight broadcast: nccl (GPU to GPU, bf16-ready), gloo or mpi on CPU
    (the same code, weight_sync.py). auto: nccl where CUDA is available, else the CPU
    backend measured faster here (bench/bench_weight_sync.py)."""
    timeout_s: float = bounded(600.0, ge=0)
    """Most seconds one weight sync may take on a member, from its start (waiting for the
    other members to join, then the transfer). Past it the member gives up (a member never
    arrived, or the transfer stalled: a hung collective) and reports it; the job checkpoints
    what still answers and exits 75, to be requeued, instead of waiting for run.worker_timeout
    or the wall-clock limit. Also the timeout of the NCCL/gloo sync groups. 0: no deadline."""


@dataclass(frozen=True)
class StoreConfig:
    chunk_rows: int = bounded(256, ge=1, le=1 << 20)
    """HDF5 chunk length of the sample tables (the token pools: 8x). A flush writes each chunk it
    touches whole, so a chunk near one flush's rows is cheapest to write (256 x 178-byte rows:
    45 KiB); bench/bench_store.py measures it."""


@dataclass(frozen=True)
class SlurmComponent:
    nodes: int = bounded(1, ge=1)
    """Nodes of this het component."""
    gpus_per_node: int = bounded(0, ge=0)
    """GPUs per node; a node's tasks x their GPUs must fit here. Rollout components: each
    replica gets its own block (`--gpus-per-task`). Trainer components and `--single`:
    `--gpus-per-node`, every rank sees its node's GPUs (NCCL's peer-to-peer paths need
    them) and takes its own (flexmarl_hpc/runtime/devices.py)."""
    cpus_per_task: int = bounded(1, ge=1)
    """CPUs per rank."""
    mem: str = "auto"
    """Host memory per node (`--mem`): a size like 400G or 64000M, 0 (all of each node's
    memory: `simulate memory` cannot check it), or auto: its GPUs on a node x
    slurm.mem_per_gpu for a component with GPUs (pinned staging, vLLM's swap space and parked
    training states grow with them), else its CPUs on a node x slurm.mem_per_cpu."""
    partition: str = ""
    """Partition of this component; empty: slurm.partition."""
    sbatch_options: list[str] = field(default_factory=list)
    """Extra `#SBATCH` options of this component, e.g. ['--constraint=a100', '--exclusive'];
    `--single` and sweeps take the trainer's."""


@dataclass(frozen=True)
class RolloutPool:
    """Replicas of one size class, the agents they may serve, and their het-job component."""

    name: str = ""
    """Pool name (labels its component and the dry-run table); empty: pool<i>."""
    replicas: int = bounded(1, ge=1)
    """Replica ranks in the pool."""
    gpus_per_replica: int = bounded(1, ge=1)
    """GPUs of one replica rank (vLLM's tensor_parallel_size lives inside it)."""
    gpu_memory_gb: float = bounded(0.0, ge=0)
    """Memory of one GPU, to check that each served model's weights fit a replica
    (0: not checked, e.g. CPU nodes)."""
    agents: list[str] = field(default_factory=list)
    """Agents the pool may serve; empty: every agent whose model fits its replicas."""
    slurm: SlurmComponent = field(default_factory=SlurmComponent)
    """This pool's het-job component (nodes, gpus_per_node, partition, sbatch_options)."""


@dataclass(frozen=True)
class TrainerGroup:
    """The trainer ranks of some agents: their shape, backend and het-job component."""

    name: str = ""
    """Group name (labels its component and the dry-run table); empty: group<i>."""
    agents: list[str] = field(default_factory=list)
    """Agents trained on this group (the first starts resident; more than one needs
    pipeline.swap_states)."""
    ranks: int = bounded(1, ge=1)
    """Ranks of the group = tensor_parallel x pipeline_parallel x data parallel."""
    tensor_parallel: int = bounded(1, ge=1)
    """Tensor-parallel degree (megatron); must divide the heads of the group's models."""
    pipeline_parallel: int = bounded(1, ge=1)
    """Pipeline-parallel degree (megatron); must divide the layers of the group's models."""
    backend: Literal["torch", "megatron"] = "torch"
    """Training engine of this group."""
    swap: str = ""
    """Swap domain: groups with the same non-empty label may take each other's agents
    (pipeline.swap_states); they must have the same ranks and backend (megatron groups may
    differ in TP/PP: the move reshards). Empty: its agents stay here."""
    slurm: SlurmComponent = field(default_factory=SlurmComponent)
    """This group's het-job component (nodes, gpus_per_node, partition, sbatch_options)."""


@dataclass(frozen=True)
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
    signal_seconds: int = bounded(120, ge=0, le=SIGNAL_MAX_S)
    """Seconds before the time limit at which SIGUSR1 asks the job to checkpoint and requeue."""
    requeue: bool = True
    """Requeue on preemption/time limit and resume."""
    start_timeout: int = bounded(600, ge=0)
    """Seconds from srun until every rank is through MPI start-up (MPI_Init, rank 0 holding
    the run lock); past it the batch script ends the step and requeues the job, which a rank
    stuck in MPI_Init would otherwise hold to its time limit (docs/slurm.md, 'MPI
    start-up'). 0: no watchdog."""
    max_restarts: int = bounded(5, ge=0, le=1000)
    """Automatic requeues in a row that end without a new checkpoint (a start that fails
    every time, a rank that dies before the next checkpoint) before the job stops for good
    with one line naming the last cause. A requeue after which some agent checkpointed
    resets the count, so a long run that is preempted or reaches its time limit many times
    is not stopped. Counted in `logs/JOB.restarts` by the batch script (a start-up that never
    gets through MPI_Init cannot write the store). 0: never requeue automatically."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before srun (module loads, venv activation)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment of every rank, exported before srun, e.g. {NCCL_SOCKET_IFNAME: ib0,
    GLOO_SOCKET_IFNAME: ib0, UCX_NET_DEVICES: 'mlx5_0:1'} (docs/slurm.md: which interface
    each transport reads). Names are shell variable names; values are written quoted."""
    mem_per_cpu: str = "1000M"
    """Memory per CPU of the components without GPUs whose `mem` is auto (their `--mem` is
    their CPUs on a node x this), e.g. 4G."""
    mem_per_gpu: str = "48G"
    """Host memory per GPU of the components with GPUs whose `mem` is auto (their `--mem` is
    their GPUs on a node x this: 768G for 16 GPUs), e.g. 120G. `simulate memory` checks each
    node's predicted host bytes against it."""
    sbatch_options: list[str] = field(default_factory=list)
    """Extra job-wide `#SBATCH` options, e.g. ['--mail-type=END', '--reservation=res1']."""
    orchestrator: SlurmComponent = field(default_factory=SlurmComponent)
    """Het component 0: the orchestrator rank."""
    rollout: SlurmComponent = field(default_factory=SlurmComponent)
    """Het component 1: the rollout pool."""
    trainer: SlurmComponent = field(default_factory=SlurmComponent)
    """Het component 2: the trainer groups."""
    tools: SlurmComponent = field(default_factory=SlurmComponent)
    """The last het component, with tools.ranks > 0: the tool ranks (CPU nodes; each rank
    runs tools.workers sandboxes and reward functions at once, so give it that many CPUs)."""


@dataclass(frozen=True)
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
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    """Tools and reward functions of episode workflows (flexmarl_hpc/tools/, docs/tools.md)."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    # -- derived views (pure) ----------------------------------------------------------
    @property
    def agent_names(self) -> list[str]:
        """Agents in order of first appearance in the workflow."""
        if self.workflow.episode:
            return list(self.workflow.agents)
        return list(dict.fromkeys(t.agent for t in self.workflow.turns))

    def model_for(self, agent: str) -> ModelConfig:
        return self.agents.get(agent, self.model)

    @property
    def num_trainer_groups(self) -> int:
        return len(self.trainer.named_groups) or self.trainer.groups or len(self.agent_names)

    @property
    def output_dir(self) -> Path:
        return Path(self.run.output_dir.format(name=self.run.name))
