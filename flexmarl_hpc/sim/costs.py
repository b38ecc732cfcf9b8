"""Cost models of a FlexMARL job's work items, in seconds, from a hardware profile and shapes.

Pure arithmetic (numpy only), roofline-style, every assumption stated here and in the
README ("Cost model assumptions"):

- prefill is compute-bound: 2 x params x prompt tokens / (g x peak x mfu_prefill);
- a decode step is memory-bound: (weight bytes + KV bytes read) / (g x HBM bandwidth x eff),
  unless the batch makes it compute-bound (roofline max); tensor parallelism over g devices
  divides both and adds 2 all-reduces per layer over NVLink;
- a trainer micro-batch costs 6 x params x tokens / (devices x peak x mfu_train) (+ TP
  all-reduces); the optimizer step is a memory-bound Adam update over each device's shard,
  plus the data-parallel gradient reduce-scatter and parameter all-gather;
- weight sync and state swap are bytes over a link plus fixed per-bucket costs.

`CostModel` exposes what the simulated transport needs, one call per message:
`generate_s(agent, n_prompts, prompt_tokens, response_tokens)` for a Generate (prompt and
response lengths per request), `train_s(agent, tokens, optimizer_step=msg.last)` for a Train
(the optimizer runs on the last micro-batch only), `sync_s(agent, nbytes)` for a Sync and
`swap_s(agent, nbytes)` for a Move (`weight_bytes(agent)`, `state_bytes(agent)` give nbytes).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

import numpy as np

from flexmarl_hpc.sim.hardware import HardwareProfile
from flexmarl_hpc.sim.kvcache import kv_schedule

ADAM_BYTES_PER_PARAM = 30
"""Bytes an Adam step moves per parameter: fp32 master, m, v read and written (24), the fp32
gradient read (4) and the bf16 weight written (2)."""
TRAIN_STATE_BYTES_PER_PARAM = 14
"""Trainer state a swap moves per parameter: bf16 weight (2) + fp32 master, m, v (12)."""
TRAIN_RESIDENT_BYTES_PER_PARAM = 16
"""Trainer memory per parameter while training: the swap state plus a bf16 gradient."""


# ---------------------------------------------------------------------------------------
# Model shapes
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """A Llama/Qwen2-family decoder's shape; the parameter count is derived, never typed in."""

    name: str
    """Label used in messages."""
    hidden: int
    """Model width (HF `hidden_size`)."""
    layers: int
    """Decoder layers (HF `num_hidden_layers`)."""
    heads: int
    """Attention heads."""
    kv_heads: int
    """Key/value heads (GQA when < heads)."""
    intermediate: int
    """SwiGLU hidden width (HF `intermediate_size`)."""
    vocab: int
    """Vocabulary size (HF `vocab_size`)."""
    tie_embeddings: bool = False
    """Input embedding shared with the LM head."""
    qkv_bias: bool = True
    """Biases on q/k/v (Qwen2)."""
    bytes_per_param: int = 2
    """Bytes per weight as served and synced (bf16: 2)."""
    kv_bytes_per_value: int = 2
    """Bytes per cached key/value element (bf16 KV cache: 2)."""

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab",
                     "bytes_per_param", "kv_bytes_per_value"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model shape {self.name!r}: field {name!r}: expected an integer >= 1, got {v!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"model shape {self.name!r}: hidden ({self.hidden}) must divide by heads "
                             f"({self.heads}) and heads by kv_heads ({self.kv_heads})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def params(self) -> int:
        """Exact parameter count of the HF Qwen2/Llama layout."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attn = h * h + 2 * h * kv + h * h + ((h + 2 * kv) if self.qkv_bias else 0)
        layer = attn + 3 * h * self.intermediate + 2 * h           # + 2 RMSNorm weights
        embed = self.vocab * h * (1 if self.tie_embeddings else 2)
        return self.layers * layer + embed + h                     # + final norm

    @property
    def weight_bytes(self) -> int:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token adds (keys and values, every layer)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_value


# From the published HF config.json of each model (Qwen/Qwen2.5-32B-Instruct and
# Qwen/Qwen2.5-14B-Instruct on huggingface.co): hidden_size 5120, 40 heads, 8 KV heads,
# vocab 152064, untied embeddings, q/k/v bias; 64 layers x 27648 and 48 layers x 13824.
QWEN25_32B = ModelShape("Qwen2.5-32B", hidden=5120, layers=64, heads=40, kv_heads=8,
                        intermediate=27648, vocab=152064)
QWEN25_14B = ModelShape("Qwen2.5-14B", hidden=5120, layers=48, heads=40, kv_heads=8,
                        intermediate=13824, vocab=152064)
PRESETS: dict[str, ModelShape] = {"qwen2.5-32b": QWEN25_32B, "qwen2.5-14b": QWEN25_14B}


def shape_from_model_args(args, name: str = "model", bytes_per_param: int = 2) -> ModelShape:
    """The shape of the project's own model (`flexmarl_hpc.learn.model.ModelArgs`), for the
    small-model simulations and the calibration (CPU runs are fp32: bytes_per_param=4)."""
    return ModelShape(name, hidden=args.hidden_size, layers=args.num_layers, heads=args.num_heads,
                      kv_heads=args.num_kv_heads, intermediate=args.intermediate_size,
                      vocab=args.vocab_size, tie_embeddings=args.tie_embeddings,
                      qkv_bias=args.qkv_bias, bytes_per_param=bytes_per_param,
                      kv_bytes_per_value=bytes_per_param)


# ---------------------------------------------------------------------------------------
# Layout of one agent on the hardware
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AgentLayout:
    """Where one agent's model runs: its replicas' width and its trainer group's shape."""

    model: ModelShape
    """The agent's model."""
    gpus_per_replica: int = 1
    """Devices per inference replica (tensor parallel inside the replica)."""
    trainer_devices: int = 8
    """Devices of the agent's trainer group (tp x pp x dp)."""
    trainer_tp: int = 1
    """Tensor-parallel width inside the trainer group."""
    trainer_pp: int = 1
    """Pipeline stages inside the trainer group (bubble ignored: see README)."""
    max_num_seqs: int = 256
    """Most sequences a replica decodes at once (vLLM's max_num_seqs)."""
    bucket_bytes: int = 1024 * 2**20
    """Weight-sync bucket size (weight_sync.bucket_mb, default 1024 MiB)."""
    sync_link: Literal["inter_node", "intra_node"] = "inter_node"
    """Link a weight sync crosses: trainer and replicas on other nodes, or the same node."""
    swap_link: Literal["host", "inter_node"] = "host"
    """Where a suspended trainer's state goes: host memory over PCIe, or another node."""
    recompute: float = 0.0
    """Fraction of the layers whose forward the backward runs again (megatron activation
    recompute, `recompute_fraction`): 0 none or selective (core attention only, whose FLOPs the
    6 x params count leaves out), 1 full uniform, a stage's recomputed share for full block."""

    @property
    def trainer_dp(self) -> int:
        return self.trainer_devices // (self.trainer_tp * self.trainer_pp)

    def validate(self, hw: HardwareProfile, where: str = "agent layout") -> AgentLayout:
        """Raise ValueError naming the field when the layout cannot run on `hw`."""
        for name in ("gpus_per_replica", "trainer_devices", "trainer_tp", "trainer_pp",
                     "max_num_seqs", "bucket_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{where}: field {name!r}: expected an integer >= 1, got {v!r}")
        if self.trainer_devices % (self.trainer_tp * self.trainer_pp):
            raise ValueError(f"{where}: field 'trainer_devices' ({self.trainer_devices}) must be a "
                             f"multiple of trainer_tp x trainer_pp ({self.trainer_tp * self.trainer_pp})")
        if self.sync_link not in ("inter_node", "intra_node"):
            raise ValueError(f"{where}: field 'sync_link': expected inter_node or intra_node, got {self.sync_link!r}")
        if self.swap_link not in ("host", "inter_node"):
            raise ValueError(f"{where}: field 'swap_link': expected host or inter_node, got {self.swap_link!r}")
        if not 0.0 <= self.recompute <= 1.0:
            raise ValueError(f"{where}: field 'recompute': expected a fraction in [0, 1], got {self.recompute!r}")
        kv_room(hw, self.model, self.gpus_per_replica, where)
        need = TRAIN_RESIDENT_BYTES_PER_PARAM * self.model.params / self.trainer_devices
        if need > hw.hbm_bytes * hw.efficiency.gpu_memory_utilization:
            raise ValueError(f"{where}: field 'trainer_devices': {self.trainer_devices} devices hold "
                             f"{need / 1e9:.1f} GB of {self.model.name} training state each, more than "
                             f"{hw.name}'s usable {hw.hbm_gb * hw.efficiency.gpu_memory_utilization:.1f} GB")
        return self


# ---------------------------------------------------------------------------------------
# Response lengths
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LengthDistribution:
    """Declared response-length distribution: a lognormal clipped to [min_tokens, max_tokens]."""

    median: float = 1024.0
    """Median response length, tokens (the lognormal's exp(mu))."""
    sigma: float = 0.8
    """Lognormal shape: 0 gives every response `median` tokens; 0.8 puts ~0.4% at the cap of 8192 (mean ~1400)."""
    min_tokens: int = 1
    """Shortest response."""
    max_tokens: int = 8192
    """Longest response (the paper's max response length)."""

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.sigma >= 0 and 1 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"length distribution: need median > 0, sigma >= 0 and "
                             f"1 <= min_tokens <= max_tokens, got {self}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` lengths (int64) from a seeded Generator: the same seed gives the same lengths."""
        draw = rng.lognormal(math.log(self.median), self.sigma, size=n) if self.sigma else np.full(n, self.median)
        return np.clip(np.rint(draw), self.min_tokens, self.max_tokens).astype(np.int64)


# ---------------------------------------------------------------------------------------
# Building blocks (pure functions)
# ---------------------------------------------------------------------------------------
def link_bandwidth(hw: HardwareProfile, devices: int) -> float:
    """Per-device bandwidth of a collective over `devices`: NVLink inside a node, NICs across."""
    return hw.intra_node_bandwidth if devices <= hw.devices_per_node else hw.inter_node_bandwidth_per_device


def ring_allreduce_s(hw: HardwareProfile, nbytes: float, devices: int, count: int = 1,
                     span: int = 0) -> float:
    """`count` ring all-reduces of `nbytes` each over `devices` (2(g-1)/g of the bytes per
    device); `span` is the device count the group is spread over (default `devices`), which
    decides whether the ring crosses nodes."""
    if devices <= 1 or count <= 0:
        return 0.0
    moved = 2 * (devices - 1) / devices * nbytes
    bw = link_bandwidth(hw, span or devices) * hw.efficiency.link
    return count * (hw.efficiency.collective_latency_s + moved / bw)


def kv_room(hw: HardwareProfile, model: ModelShape, g: int, where: str = "replica") -> float:
    """Bytes left for the KV cache on a replica of `g` devices once the weights are in."""
    room = g * hw.hbm_bytes * hw.efficiency.gpu_memory_utilization - model.weight_bytes
    if room <= 0:
        raise ValueError(f"{where}: field 'gpus_per_replica': {model.name} ({model.weight_bytes / 1e9:.1f} GB "
                         f"of weights) does not fit in {g} x {hw.hbm_gb:g} GB ({hw.name}) at "
                         f"gpu_memory_utilization {hw.efficiency.gpu_memory_utilization}")
    return room


def prefill_s(hw: HardwareProfile, model: ModelShape, tokens, g: int = 1):
    """Prefill of `tokens` prompt tokens on a replica of `g` devices (TP): compute-bound, but
    never faster than one read of the weights; 0 tokens cost 0. Vectorised: an array of token
    counts gives an array of seconds."""
    t = np.asarray(tokens, dtype=np.float64)
    compute = 2 * model.params * t / (g * hw.peak_flops * hw.efficiency.mfu_prefill)
    weights = model.weight_bytes / (g * hw.hbm_bandwidth * hw.efficiency.hbm)
    tp = ring_allreduce_s(hw, t * model.hidden * model.bytes_per_param, g, 2 * model.layers)
    out = np.where(t > 0, np.maximum(compute, weights) + tp, 0.0)
    return float(out) if out.ndim == 0 else out


def decode_step_s(hw: HardwareProfile, model: ModelShape, batch, context, g: int = 1):
    """One decode step of `batch` sequences holding `context` cached tokens in all (sums over
    the batch), on `g` devices. Vectorised: arrays in, array out; a batch of 0 costs 0."""
    batch = np.asarray(batch, dtype=np.float64)
    context = np.asarray(context, dtype=np.float64)
    eff = hw.efficiency
    kv_split = min(g, model.kv_heads)          # KV heads shard over TP; beyond that they replicate
    read = model.weight_bytes / g + model.kv_bytes_per_token * context / kv_split
    memory = read / (hw.hbm_bandwidth * eff.hbm)
    compute = 2 * model.params * batch / (g * hw.peak_flops * eff.mfu_decode)
    tp = 0.0
    if g > 1:
        moved = 2 * (g - 1) / g * batch * model.hidden * model.bytes_per_param
        tp = 2 * model.layers * (eff.collective_latency_s + moved / (link_bandwidth(hw, g) * eff.link))
    step = np.maximum(memory, compute) + tp + eff.decode_step_overhead_s
    return np.where(batch > 0, step, 0.0)


def decode_schedule(lengths: np.ndarray, prompt_tokens: float, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Continuous batching of responses of `lengths` tokens on `slots` sequence slots: each
    response starts (in order) on the first slot to free up. Returns per decode step the
    number of active sequences and the tokens they hold in all."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n <= slots:
        starts = np.zeros(n, dtype=np.int64)
    else:
        free = [0] * slots                      # min-heap of the step at which each slot frees
        starts = np.empty(n, dtype=np.int64)
        for i, length in enumerate(lengths.tolist()):
            starts[i] = heapq.heappop(free)
            heapq.heappush(free, starts[i] + length)
    ends = starts + lengths
    horizon = int(ends.max()) if n else 0
    count = np.zeros(horizon + 1, dtype=np.int64)
    start_sum = np.zeros(horizon + 1, dtype=np.int64)
    np.add.at(count, starts, 1)
    np.add.at(count, ends, -1)
    np.add.at(start_sum, starts, starts)
    np.add.at(start_sum, ends, -starts)
    active = np.cumsum(count)[:horizon]
    steps = np.arange(horizon)
    # At step t a sequence started at s holds prompt + (t - s) tokens.
    held = active * (prompt_tokens + steps) - np.cumsum(start_sum)[:horizon]
    return active, held


def replica_slots(hw: HardwareProfile, layout: AgentLayout, prompt_tokens: float, lengths: np.ndarray) -> int:
    """Sequences a replica decodes at once by the batch's mean context: max_num_seqs, or fewer
    when the KV cache is full at the mean context (the closed-form planner's estimate; the
    simulator's `generate_s` runs `kv_schedule` instead, with admission and preemption)."""
    mean_ctx = prompt_tokens + (float(np.mean(lengths)) if len(lengths) else 0.0)
    by_memory = kv_room(hw, layout.model, layout.gpus_per_replica) // max(
        layout.model.kv_bytes_per_token * mean_ctx, 1.0)
    return int(max(1, min(layout.max_num_seqs, by_memory)))


def kv_capacity_tokens(hw: HardwareProfile, layout: AgentLayout) -> int:
    """Tokens the KV cache of one replica holds (KV room / bytes per token)."""
    return int(kv_room(hw, layout.model, layout.gpus_per_replica) // layout.model.kv_bytes_per_token)


def generate_s(hw: HardwareProfile, layout: AgentLayout, prefill_tokens: int, prompt_tokens: float,
               lengths: np.ndarray, closed_form: bool = False) -> float:
    """A replica generating the responses `lengths`: one prefill of `prefill_tokens` (the
    prompts once: branches share it, as vLLM's parallel sampling does), then continuous
    batching of responses that start from `prompt_tokens` cached tokens (the mean prompt) on
    max_num_seqs slots; when the cache would overflow, `kv_schedule` queues admissions and
    preempts (the re-prefilled tokens are paid). `closed_form`: slots by the mean context
    instead (the planner's fast estimate)."""
    g, model = layout.gpus_per_replica, layout.model
    total = prefill_s(hw, model, prefill_tokens, g)
    if len(lengths):
        if closed_form:
            active, held = decode_schedule(lengths, prompt_tokens, replica_slots(hw, layout, prompt_tokens, lengths))
        else:
            active, held = decode_schedule(lengths, prompt_tokens, layout.max_num_seqs)
            cap = kv_capacity_tokens(hw, layout)
            if len(held) and int((held + active).max()) > cap:
                active, held, again = kv_schedule(lengths, round(prompt_tokens), layout.max_num_seqs, cap)
                total += prefill_s(hw, model, again, g) if again else 0.0
        total += float(decode_step_s(hw, model, active, held, g).sum())
    return total + hw.efficiency.call_overhead_s


def train_compute_s(hw: HardwareProfile, layout: AgentLayout, tokens: int) -> float:
    """Forward + backward of `tokens` tokens on the trainer group (6 x params x tokens FLOPs),
    plus its tensor-parallel all-reduces (4 per layer, not overlapped); activation recompute
    runs that share of the forward again (2 x params x tokens and 2 all-reduces per layer)."""
    if tokens <= 0:
        return 0.0
    m, again = layout.model, layout.recompute
    flops = (6 + 2 * again) * m.params * tokens / (layout.trainer_devices * hw.peak_flops * hw.efficiency.mfu_train)
    per_dp = tokens / layout.trainer_dp
    tp = ring_allreduce_s(hw, per_dp * m.hidden * m.bytes_per_param, layout.trainer_tp,
                          (4 + 2 * again) * math.ceil(m.layers / layout.trainer_pp))
    return flops + tp


def recompute_fraction(recompute: str, method: str, num_layers: int, layers: int, pp: int) -> float:
    """The share of a stage's layers megatron recomputes (trainer.recompute, recompute_method,
    recompute_num_layers): full uniform all of them, full block the first `num_layers` of
    each stage's layers / pp, none and selective 0 (see AgentLayout.recompute)."""
    if recompute != "full":
        return 0.0
    return 1.0 if method == "uniform" else min(num_layers / max(layers // pp, 1), 1.0)


def optimizer_s(hw: HardwareProfile, layout: AgentLayout) -> float:
    """An optimizer step: data-parallel gradient reduce-scatter and parameter all-gather
    (bf16, not overlapped) and the memory-bound Adam update of each device's shard
    (distributed optimizer: params / devices per device)."""
    m = layout.model
    shard = m.params / layout.trainer_devices
    adam = ADAM_BYTES_PER_PARAM * shard / (hw.hbm_bandwidth * hw.efficiency.hbm)
    dp = layout.trainer_dp
    grads = m.params / (layout.trainer_tp * layout.trainer_pp) * m.bytes_per_param
    # reduce-scatter + all-gather move what one all-reduce moves: 2(dp-1)/dp of the bytes.
    # TP is the innermost dimension, so the DP ring crosses nodes once the group does.
    comm = ring_allreduce_s(hw, grads, dp, span=layout.trainer_devices)
    return adam + comm + hw.efficiency.optimizer_overhead_s


def transfer_s(nbytes: float, bandwidth: float, chunk: float, latency: float) -> float:
    """`nbytes` over a link of `bandwidth` bytes/s, in chunks of `chunk` bytes costing `latency` each."""
    if nbytes <= 0:
        return 0.0
    return nbytes / bandwidth + math.ceil(nbytes / chunk) * latency


# ---------------------------------------------------------------------------------------
# The cost object the simulated transport uses
# ---------------------------------------------------------------------------------------
class CostModel:
    """Seconds each work item takes, per agent, on one hardware profile.

        costs = CostModel(load_hardware("h100_ndr"), {"solver": AgentLayout(QWEN25_32B, 4, 16, 4)})
        costs.generate_s("solver", n_prompts=8, prompt_tokens=512, response_tokens=lengths)
    """

    def __init__(self, hardware: HardwareProfile, agents: Mapping[str, AgentLayout]):
        self.hw = hardware
        self.agents = {a: lay.validate(hardware, f"agent {a!r}") for a, lay in agents.items()}

    def layout(self, agent: str) -> AgentLayout:
        try:
            return self.agents[agent]
        except KeyError:
            raise KeyError(f"cost model has no agent {agent!r} (has {sorted(self.agents)})") from None

    def generate_s(self, agent: str, n_prompts: int, prompt_tokens: int | Sequence[int] | np.ndarray,
                   response_tokens: int | Sequence[int] | np.ndarray) -> float:
        """One replica of `agent` serving `n_prompts` prompts.
        `prompt_tokens`: one length for all prompts, or each prompt's length (n_prompts of them).
        `response_tokens`: every response's length (any count, e.g. prompts x branches), or
        one int meaning one response of that length per prompt."""
        prompts = np.asarray(prompt_tokens, dtype=np.int64).ravel()
        if np.ndim(prompt_tokens) and len(prompts) != n_prompts:
            raise ValueError(f"generate_s: {len(prompts)} prompt lengths for n_prompts={n_prompts}")
        if n_prompts < 0 or (prompts < 0).any():
            raise ValueError(f"generate_s: n_prompts and prompt_tokens must be >= 0, got {n_prompts}, {prompt_tokens}")
        if np.ndim(response_tokens) == 0:
            lengths = np.full(n_prompts, int(response_tokens), dtype=np.int64)
        else:
            lengths = np.asarray(response_tokens, dtype=np.int64).ravel()
        if (lengths < 0).any():
            raise ValueError(f"generate_s: response lengths must be >= 0, got min {lengths.min()}")
        prefill = int(prompts.sum()) if np.ndim(prompt_tokens) else n_prompts * int(prompts[0])
        mean_prompt = prefill / n_prompts if n_prompts else 0.0
        return generate_s(self.hw, self.layout(agent), prefill, mean_prompt, lengths[lengths > 0])

    def train_s(self, agent: str, tokens: int, optimizer_step: bool = True) -> float:
        """Forward/backward over `tokens` tokens on `agent`'s trainer group, plus the optimizer
        step when `optimizer_step` (the last micro-batch of a global batch)."""
        lay = self.layout(agent)
        t = train_compute_s(self.hw, lay, tokens) + self.hw.efficiency.call_overhead_s
        return t + (optimizer_s(self.hw, lay) if optimizer_step else 0.0)

    def sync_s(self, agent: str, nbytes: float) -> float:
        """Weight sync of `nbytes` from the trainer group to the replicas (pipelined broadcast:
        the time of one link, whatever the number of receivers), plus per-bucket latency."""
        lay, eff = self.layout(agent), self.hw.efficiency
        bw = self.hw.inter_node_bandwidth_per_device if lay.sync_link == "inter_node" else self.hw.intra_node_bandwidth
        return transfer_s(nbytes, bw * eff.link, lay.bucket_bytes, eff.bucket_latency_s)

    def swap_s(self, agent: str, nbytes: float) -> float:
        """Suspending or resuming a trainer group's state of `nbytes` (all its devices move
        their shards at once, each over its own PCIe link or NIC share)."""
        lay, eff = self.layout(agent), self.hw.efficiency
        per_dev = self.hw.host_device_bandwidth if lay.swap_link == "host" else self.hw.inter_node_bandwidth_per_device
        return transfer_s(nbytes, lay.trainer_devices * per_dev * eff.link, lay.bucket_bytes, eff.bucket_latency_s)

    def weight_bytes(self, agent: str) -> int:
        """Bytes a weight sync of `agent` moves."""
        return self.layout(agent).model.weight_bytes

    def state_bytes(self, agent: str) -> int:
        """Bytes a state swap of `agent`'s trainer moves (weights + fp32 master and Adam moments)."""
        return TRAIN_STATE_BYTES_PER_PARAM * self.layout(agent).model.params
