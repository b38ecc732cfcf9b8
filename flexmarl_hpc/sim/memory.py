"""Memory check at a config's real shapes, on CPU: `python -m flexmarl_hpc.simulate memory CONFIG`.

Trainer ranks: the production code runs on fake tensors (sim/fake_memory.py) over a fake
process group (trainer/megatron/fake.py): `build.build_trainer`, one `forward_backward` at
trainer.micro_batch_size rows of model.max_seq_len tokens (this rank's share, as the runtime
cuts it), `optimizer_step`, then the sender side of a streamed weight sync (two buffers of the
plan's largest bucket, `runtime/weight_sync.py`'s plan, views and fill loop, `sync_stream`'s
row ranges gathered from the TP shards in place in them). Per distinct group shape these ranks run: every
pipeline stage's sync sender (rank 0, the leader, is the first stage's; the last stage's
sends the LM head) and the last rank (a rank that sends nothing); a node holds the leader and
ranks_per_node - 1 ranks like the largest of the others.

Torch-engine replica ranks (rollout.backend torch): run, as the trainers are, on fake tensors
(sim/torch_replica.py): `build.build_engine`, every served agent's weight receive (the
receive buffer, a relay's second, the engine's load) and a generate at rollout.max_batch;
host bytes (a CPU engine), checked on the node against the pool's --mem.

vLLM replica ranks: vLLM cannot run here, so a replica is accounted, not run: vLLM's documented
use (it takes `gpu_memory_utilization` of every GPU's total memory, the pool's
`vllm_engine.memory_fraction`, and refuses to start when that cannot hold the weights' TP
shard and one rollout.max_model_len sequence's KV cache), then a weight receive's one buffer
beside it, of a bucket or of the largest tensor sent in pieces (`build.receive_span` at the
wire dtype), and the sync communicators its workers join. No host copies: agents
sharing an engine are re-sent by the trainer.

GPU ranks also hold what no tensor shows (config/gpu_memory.py, each with its source): a
CUDA context, each NCCL communicator (counted per rank from the layout) and the allocator's
fragmentation; the table prints each beside the tensors, and each refusal says its remedy.
A checkpoint save is counted from the trainer's real DDP buffers (`save_spike`).

Limits: a rank's device memory is its pool's `gpu_memory_gb`, a trainer rank's the hardware
profile's `hbm_gb` (groups have no memory field); a node's host memory is its component's
`--mem` (config/resources.component_mem, the rule the script uses: `slurm.mem`, auto its GPUs
x `slurm.mem_per_gpu`; 0, the whole node: not checked). Every pool's and group's node is
checked (its tensors' host bytes: a rank's interpreter and libraries are not counted). Exit 1
names every rank and node over.
"""
from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass

import torch

from flexmarl_hpc.config.plan import Plan
from flexmarl_hpc.config.resources import Group, mem_mb
from flexmarl_hpc.config.hf_config import model_args
from flexmarl_hpc.config.schema import Config
from flexmarl_hpc.learn.model import hf_shapes

GB = 1e9
VLLM_GPU_MEMORY_UTILIZATION = 0.85
"""The fraction rollout/vllm_engine.py passes to vLLM's LLM(gpu_memory_utilization=...)."""
REPLICA_HEAD = ("the torch engine run", "the pool's vLLM memory fraction + one bucket + sync communicators")
"""What the report's head says a replica's rows are (torch pools, vLLM pools)."""


@dataclass
class Row:
    component: str
    """Pool or group name."""
    rank: str
    """Which rank (world rank and role)."""
    phase: str
    device_bytes: int
    """Peak device bytes of the rank during the phase (per GPU)."""
    host_bytes: int
    """Peak host bytes of the rank during the phase."""
    device_limit: int
    node_host_bytes: int = 0
    """Peak host bytes of the rank's node (0: not a node total row)."""
    node_limit: int = 0
    """The node's --mem in bytes (0: not set, not checked)."""
    tensor_bytes: int = -1
    """Peak device bytes of the rank's tensors (-1: device_bytes, no allowances added)."""
    context: int = 0
    """The CUDA context counted on top (config/gpu_memory.py)."""
    nccl: int = 0
    """The NCCL communicators' buffers counted on top."""
    comms: int = 0
    """How many NCCL communicators the rank holds."""
    fragmentation: int = 0
    """The caching allocator's rounding and fragmentation counted on top."""
    remedy: str = ""
    """What would make this row fit, said when it does not."""


# ---------------------------------------------------------------------------------------
# trainer ranks: the production code on fake tensors
# ---------------------------------------------------------------------------------------
def _micro_batch(rows: int, T: int, vocab: int):
    """A full micro-batch of real (small) tensors: prompt of half the tokens, the rest response."""
    from flexmarl_hpc.learn.grpo import MicroBatch
    g = torch.Generator().manual_seed(0)
    return MicroBatch(torch.randint(0, vocab, (rows, T), generator=g), torch.full((rows,), T // 2),
                      torch.full((rows,), T - T // 2), torch.zeros(rows, T), torch.ones(rows),
                      torch.zeros(rows, dtype=torch.bool), None)


def train_tokens(cfg: Config, task, agent: str, max_seq_len: int) -> int:
    """The longest sequence `agent` trains on (micro-batches are padded to their longest):
    its longest prompt plus budget on the preflight walk (torch_replica.generate_shape), so a
    checkpoint's 8,192-token context is not charged to a task of 60-token sequences; an
    episode workflow's, max_seq_len. Within rollout.max_model_len where set."""
    from flexmarl_hpc.sim.torch_replica import generate_shape
    _, prompt, budget = generate_shape(cfg, task, agent, max_seq_len)
    return min(prompt + budget, max_seq_len, cfg.rollout.max_model_len or max_seq_len)


@dataclass(frozen=True)
class Phase:
    """One phase of a trainer rank, in bytes."""
    name: str
    device: int
    """Peak device bytes during the phase."""
    host: int
    """Peak host bytes during the phase."""
    total: int
    """Peak of device + host together (what a CPU run holds in RAM)."""
    device_live: int
    """Device bytes still held at the phase's end (the trainer's state after the optimizer step)."""


def trainer_rank(plan: Plan, task, g: int, rank: int, wire: torch.dtype | None,
                 limit: int = 0, tokens: int = 0) -> list[Phase]:
    """The phases of rank `rank` of trainer group `g`: build, train step, optimizer step,
    weight sync (send, on a PP stage's sender only). Stops after a phase whose device peak is over `limit`
    (> 0): on the device the run would end there. `tokens`: the micro-batch's sequence
    length (0: `train_tokens`)."""
    from flexmarl_hpc.ranks import build
    from flexmarl_hpc.sim.fake_memory import track
    from flexmarl_hpc.trainer.megatron.fake import fake_group
    cfg, group, tcfg = plan.cfg, plan.groups[g], plan.trainers[g]
    agent = group.agents[0]
    args = model_args(cfg, task, agent)
    full = _micro_batch(cfg.trainer.micro_batch_size, tokens or train_tokens(cfg, task, agent, args.max_seq_len),
                        args.vocab_size)
    size = group.ranks
    shapes = hf_shapes(args)
    out: list[Phase] = []
    with fake_group(rank, size, tcfg.tensor_parallel, tcfg.pipeline_parallel) as comm, track() as c:
        comm.hf_shapes = shapes

        def phase(name) -> bool:
            gc.collect()           # autograd graphs left in reference cycles: free, as a real run's gc does
            out.append(Phase(name, c.peak["device"], c.peak["host"], c.peak["all"], c.live["device"]))
            c.reset_peak()
            return bool(limit) and out[-1].device > limit
        tr = build.build_trainer(plan, task, agent, comm, "cpu", g)
        if phase("build"):
            return out
        tr.forward_backward(tr.share(full), 1.0 / cfg.trainer.micro_batch_size, last=True)
        if phase("train step"):
            return out
        tr.optimizer_step()
        if phase("optimizer step"):
            return out
        per_stage = size // tcfg.pipeline_parallel
        out.append(save_spike(tr, out[-1].device_live, c.live["host"], per_stage // tcfg.tensor_parallel,
                              rank % per_stage // tcfg.tensor_parallel))
        if (limit and out[-1].device > limit) or rank not in tr.sync_senders():
            return out
        _send(tr, cfg.weight_sync.bucket_mb, wire)
        phase("weight sync (send)")
    return out


def save_spike(tr, device_live: int, host_live: int, dp: int, dp_rank: int = 0) -> Phase:
    """A checkpoint save's peak (trainer/megatron/dist_ckpt.py: format fully_reshardable,
    mem_efficient), counted from this rank's real DDP buffers, since the save itself writes
    files. megatron-core 0.16's `get_parameter_state_dp_zero(use_gloo_comm=True)`
    (distrib_optimizer.py), for each buffer's bucket and each of param, exp_avg, exp_avg_sq,
    all on the host: every rank its local shard (12 B x numel / DP over the three states);
    DP rank 0 also the "world" tensors of all three states (12 B x the buffers' unpadded
    numel), the DP ranks' shards received (4 B x numel) and their concatenation (4 B x numel).
    Then dist_checkpointing stages the rank's model shard on the host (its weights' bytes;
    only one DP replica writes a shard, so this overstates DP ranks > 0). No device bytes.
    With one DP rank dist_ckpt.py writes the states into the world tensors directly. Without
    trainer.overlap_grad_reduce megatron makes one bucket of the whole buffer."""
    opts = tr._dist_optimizers()
    buckets = [b.grad_data.numel() for o in opts for buf in o.buffers for b in buf.buckets] or [0]
    world = sum(buf.numel_unpadded for o in opts for buf in o.buffers)
    weights = sum(p.numel() * p.element_size() for p in tr.model.parameters())
    big = max(buckets)
    if dp == 1:
        host = 12 * world
    else:
        host = int(12 * big / dp) + ((12 * world + 8 * big) if dp_rank == 0 else 0)
    host += weights
    return Phase("checkpoint save", device_live, host_live + host, device_live + host_live + host, device_live)


def _send(tr, bucket_mb: float, wire: torch.dtype | None) -> None:
    """The sender's side of a streamed sync as runtime/weight_sync._send_stage runs it on a
    GPU, through the same loop (`weight_sync.fill_stage`): two bucket buffers on the device
    (the plan's largest bucket: at most one, a larger tensor goes in pieces), each HF tensor
    of the rank's stage assembled from the TP shards in place in the bucket being filled
    (`sync_stream` with a `weight_sync.Destination`; a column block through the other
    buffer); the broadcast moves nothing on the fake process group, and its waits return."""
    from flexmarl_hpc.runtime import weight_sync
    from flexmarl_hpc.sim.fake_memory import device_scope
    buckets = weight_sync.plan_buckets(tr.sync_layouts()[tr.pp_rank], int(bucket_mb * 2**20), wire)
    largest = max((b.total for b in buckets), default=0)
    with device_scope():
        buffers = [torch.empty(largest, dtype=torch.uint8) for _ in range(2)]
    plan = weight_sync.SyncPlan((0,), (buckets,))
    dest = weight_sync.Destination(plan)
    stream = iter(tr.sync_stream(weight_sync.row_pieces(plan), dest))
    weight_sync.fill_stage(buckets, stream, dest, buffers.__getitem__, lambda slot, flat: None, lambda slot: None)


def _trainer_job(job: tuple) -> list[Phase]:
    """One trainer rank in a fresh process (megatron's state is per process)."""
    import warnings
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    plan, g, rank, wire, limit, *tokens = job
    from flexmarl_hpc.workflows.build import build_task
    return trainer_rank(plan, build_task(plan.cfg), g, rank, wire, limit, *tokens)


def run_jobs(jobs: list[tuple], workers: int) -> list[list[Phase]]:
    """Each job in its own process (megatron and torch.distributed are per-process state),
    `workers` at a time: forked, with megatron imported first so the children share it; or
    spawned where this process already runs torch.distributed (a fork would inherit it)."""
    import multiprocessing
    import torch.distributed as tdist
    import flexmarl_hpc.trainer.megatron  # noqa: F401
    method = "spawn" if tdist.is_available() and tdist.is_initialized() else "fork"
    with multiprocessing.get_context(method).Pool(workers, maxtasksperchild=1) as pool:
        return pool.map(_trainer_job, jobs, chunksize=1)


# ---------------------------------------------------------------------------------------
# replica ranks: our receive path on fake tensors, vLLM's documented use
# ---------------------------------------------------------------------------------------
def replica_rows(plan: Plan, task, p: int, first_rank: int, device_limit: int, node_limit: int,
                 wire: torch.dtype | None) -> list[Row]:
    """A replica of pool `p`, on each of its GPUs (one vLLM TP worker each): vLLM's budget, the
    pool's memory fraction (rollout/vllm_engine.memory_fraction, which leaves a weight sync its
    bucket and its sync communicators' NCCL buffers), must hold the weights' TP shard and one
    rollout.max_model_len sequence's KV cache or vLLM refuses to start; vLLM's own CUDA
    context, TP communicator and allocator slack are inside that budget (it measures them
    before sizing its KV cache). A weight receive then adds, outside it: one buffer of a
    bucket or of the largest tensor larger than a bucket (its pieces land in place:
    weight_sync.SyncPlan.span, SyncWorker.flexmarl_recv) with the allocator's rounding, and one
    NCCL communicator per trainer group feeding the pool (config/gpu_memory.py). Host:
    nothing model-sized (agents sharing an engine are re-sent by the trainer, not kept)."""
    from flexmarl_hpc.config.gpu_memory import allowances, replica_sync_comms
    from flexmarl_hpc.rollout.vllm_engine import memory_fraction
    from flexmarl_hpc.ranks import build
    from flexmarl_hpc.runtime import weight_sync
    cfg, pool = plan.cfg, plan.pools[p]
    bucket_bytes = int(cfg.weight_sync.bucket_mb * 2**20)
    comms = len(replica_sync_comms(plan, p))
    models = [model_args(cfg, task, a) for a in pool.agents]
    bucket = build.receive_span(cfg, models, wire)              # a split tensor lands whole
    fraction = memory_fraction(pool.gpu_memory_gb, bucket, comms) if pool.gpu_memory_gb else \
        VLLM_GPU_MEMORY_UTILIZATION
    start = 0
    for args in models:
        layout = [(k, shape, torch.float32) for k, shape in hf_shapes(args).items()]
        buckets = weight_sync.plan_buckets(layout, bucket_bytes, wire)
        start = max(start, _engine_need(args, sum(b.total for b in buckets), pool.gpus_per_replica, fraction,
                                        cfg.rollout.max_model_len))
    engine = max(int(fraction * device_limit), start)
    extra = allowances(bucket, comms, context=False)
    name, where = f"pool {pool.name}", f"rank {first_rank} (replica 0, GPU 0)"
    over_start = (f"raise pool {pool.name}'s gpus_per_replica (TP {pool.gpus_per_replica}: each GPU holds 1/TP "
                  "of the weights and KV cache) or lower rollout.max_model_len")
    over_recv = (f"lower weight_sync.bucket_mb ({cfg.weight_sync.bucket_mb:g}) or feed pool {pool.name} from fewer "
                 f"trainer groups ({comms} sync communicators a GPU)")
    if engine > int(fraction * device_limit):     # vLLM needs more than its fraction: no room is left
        over_recv = over_start + " (vLLM needs more than its memory fraction to start, so the receive has no room)"
    return [Row(name, where, "engine start (vLLM fraction)", engine, 0, device_limit, 0, node_limit,
                remedy=over_start),
            Row(name, where, "weight receive (one bucket)", engine + bucket + extra.total, 0, device_limit, 0,
                node_limit, engine + bucket, 0, extra.nccl, extra.comms, extra.fragmentation, over_recv)]


def torch_replica_rows(plan: Plan, task, p: int, first_rank: int, wire: torch.dtype | None) -> list[Row]:
    """A torch-engine replica of pool `p` (sim/torch_replica.py: its engine, weight receive
    and generate run on fake tensors). It runs on the CPU: host bytes, no device limit; the
    node row holds the pool's replicas a node against its --mem."""
    from flexmarl_hpc.sim.torch_replica import torch_replica
    name, where = f"pool {plan.pools[p].name}", f"rank {first_rank} (replica 0, CPU)"
    return [Row(name, where, f"{ph.name} (torch engine)", 0, ph.host, 0)
            for ph in torch_replica(plan, task, p, wire)]


def _engine_need(args, weight_bytes: int, tp: int, fraction: float = VLLM_GPU_MEMORY_UTILIZATION,
                 max_model_len: int = 0) -> int:
    """GPU memory vLLM needs to start: its budget (gpu_memory_utilization x total) must hold
    the weights' TP shard and the KV cache of at least one sequence of the engine's
    max_model_len (rollout.max_model_len within the model's max_seq_len, as
    rollout/vllm_engine.py passes it; K and V, bf16), else it refuses; so total >= (weights /
    tp + kv) / utilization."""
    tokens = min(max_model_len or args.max_seq_len, args.max_seq_len)
    kv = 2 * args.num_layers * args.num_kv_heads * args.head_dim * tokens * 2 // tp
    return int((weight_bytes // tp + kv) / fraction)


# ---------------------------------------------------------------------------------------
# the analytic count, to cross-check the fake-tensor run
# ---------------------------------------------------------------------------------------
def analytic_device(params_on_rank: int, dp: int, bf16: bool, rows: int, seq: int, hidden: int, heads: int,
                    layers_on_rank: int, recompute: str, tp: int) -> dict[str, int]:
    """Device bytes of a megatron rank by formula, to cross-check the fake-tensor run.
    states: weights (2 B/param in bf16, 4 in fp32), the fp32 grad buffer (4), and over the DP
    ranks the fp32 main params (4, bf16 only) and Adam m, v (8). activations of `rows` x `seq`
    tokens: one layer holds s b h (10 + 24 / t + 5 a s / (h t)) bytes (Korthikanti et al. 2022,
    16-bit, no sequence parallelism); without recompute every layer of the rank holds it, with
    full recompute each layer keeps its 2 s b h input and the one layer being recomputed holds
    its activations and their gradients (2x). buffer: megatron's global memory buffer, which the
    unfused attention of the local layer spec takes for one layer's scores (rows x heads / t x
    seq x seq) and keeps after the first step."""
    w = 2 if bf16 else 4
    states = params_on_rank * (w + 4) + params_on_rank * (12 if bf16 else 8) // dp
    buffer = rows * heads // tp * seq * seq * w
    sbh = rows * seq * hidden
    layer = int(sbh * (10 + 24 / tp + 5 * heads * seq / (hidden * tp))) * w // 2
    act = 2 * sbh * layers_on_rank * w // 2 + 2 * layer if recompute == "full" else layer * layers_on_rank
    return {"states": states, "buffer": buffer, "activations": act}


# ---------------------------------------------------------------------------------------
# the whole config
# ---------------------------------------------------------------------------------------
def _limits(cfg: Config, hbm_gb: float) -> tuple[list[int], list[int]]:
    pools = [int((p.gpu_memory_gb or hbm_gb) * GB) for p in cfg.rollout.pools] or [int(hbm_gb * GB)]
    groups = [int((getattr(g, "gpu_memory_gb", 0) or hbm_gb) * GB) for g in cfg.trainer.named_groups] \
        or [int(hbm_gb * GB)] * cfg.num_trainer_groups
    return pools, groups


def node_limit(cfg: Config, comp) -> int:
    """Het component `comp`'s --mem in bytes as its script asks for it
    (config/resources.component_mem: its `mem`, or the auto rule, one rule for both); 0:
    `mem: 0`, the whole node, whose size the config does not give: not checked."""
    from flexmarl_hpc.config.resources import component_mem
    return mem_mb(component_mem(cfg, comp)) * 2 ** 20


def _distinct(plan: Plan, task, only: tuple[str, ...] = ()) -> dict[tuple, list[int]]:
    """Trainer groups (of those named in `only`, if given) by what their ranks run: model
    shape, ranks, TP, PP, backend."""
    out: dict[tuple, list[int]] = {}
    for g, grp in enumerate(plan.groups):
        if only and grp.name not in only:
            continue
        out.setdefault((model_args(plan.cfg, task, grp.agents[0]), grp.shape), []).append(g)
    return out


def check_config(plan: Plan, hbm_gb: float, workers: int = 2, only: tuple[str, ...] = ()) -> list[Row]:
    """Every distinct role of the config (of the pools and groups named in `only`, if given):
    its rows (per phase) and node totals."""
    from flexmarl_hpc.workflows.build import build_task
    cfg = plan.cfg
    from flexmarl_hpc.runtime.weight_sync import wire_dtype, resolve_backend
    task = build_task(cfg)
    wire = wire_dtype(cfg.rollout.dtype, cfg.rollout.backend, resolve_backend(cfg.weight_sync.backend))
    pool_lim, group_lim = _limits(cfg, hbm_gb)
    comps = {c.name: c for c in plan.components}
    rows: list[Row] = []
    for p, pool in enumerate(plan.pools):
        if not only or pool.name in only:
            comp = comps.get(f"pool {pool.name}", comps.get("rollout"))
            got = replica_rows(plan, task, p, comp.first_rank, pool_lim[p], 0, wire) \
                if cfg.rollout.backend == "vllm" else torch_replica_rows(plan, task, p, comp.first_rank, wire)
            rows += got + [_node_row(f"pool {pool.name}", comp.first_rank, comp.tasks_per_node, "replicas",
                                     comp.tasks_per_node * max(r.host_bytes for r in got), node_limit(cfg, comp))]
    groups = plan.groups
    distinct = [gs for gs in _distinct(plan, task, only).values() if groups[gs[0]].backend == "megatron"]
    jobs = [(plan, gs[0], r, wire, group_lim[gs[0]]) for gs in distinct for r in checked_ranks(groups[gs[0]])]
    results = dict(zip([(j[1], j[2]) for j in jobs], run_jobs(jobs, workers)))
    for gs in distinct:              # phases once per distinct shape, every group's node against its --mem
        for g in gs:
            rows += _group_rows(plan, groups[g], g, {(g, r): v for (h, r), v in results.items() if h == gs[0]},
                                comps, group_lim[g], phases=g == gs[0])
    return rows


def _node_row(component: str, rank: int, per_node: int, what: str, host: int, limit: int) -> Row:
    return Row(component, f"rank {rank} ({per_node} {what} a node)", "node total", 0, 0, 0, host, limit)


def sender_ranks(grp: Group) -> list[int]:
    """Group rank of each PP stage's weight-sync sender (its TP rank 0 of data-parallel
    replica 0; megatron's rank order: TP fastest, then DP, then PP), as MegatronTrainer's
    `sync_senders`: the first stage's sends the embedding, the last's the LM head."""
    per_stage = grp.ranks // grp.pipeline_parallel
    return [s * per_stage for s in range(grp.pipeline_parallel)]


def checked_ranks(grp: Group) -> list[int]:
    """The ranks of a group the check runs: every stage's sender (rank 0, the leader, is the
    first's) and the last rank (last stage, no sync send: the node's other ranks)."""
    return sorted(set(sender_ranks(grp)) | {grp.ranks - 1})


def _role(grp: Group, r: int) -> str:
    if r == 0:
        return "leader, first stage"
    return f"stage {r * grp.pipeline_parallel // grp.ranks} sender" if r in sender_ranks(grp) else "last stage"


def _group_rows(plan: Plan, grp: Group, g: int, results: dict, comps: dict, limit: int,
                phases: bool = True) -> list[Row]:
    """The group's rows per checked rank and phase (`phases`) and its node total: the leader
    and ranks-per-node - 1 ranks like the largest of the others, each also holding the
    pinned host copies of its agents' training states (state swap: a rank's weights, grads
    and Adam moments, its device state after the optimizer step; runtime/state_swap.py's
    HostBuffers are kept for reuse once an agent was parked, also while it is resident
    again, so a group of n > 1 agents holds n of them; one agent is never parked). On GPUs
    each phase adds the rank's CUDA context, its NCCL communicators and the allocator's
    fragmentation (config/gpu_memory.py). A group without GPUs trains on its CPUs: its
    "device" is the node's RAM, so each rank's whole peak (device + host) counts toward the
    node's --mem, and no device limit applies."""
    from flexmarl_hpc.config.gpu_memory import allowances, trainer_comms
    cfg = plan.cfg
    name = f"group {grp.name}" if cfg.trainer.named_groups else "trainer"
    base = comps[name].first_rank + (0 if cfg.trainer.named_groups else
                                     sum(x.ranks for x in plan.groups[:g]))
    cpu = comps[name].slurm.gpus_per_node == 0
    rows, ranks = [], checked_ranks(grp)
    for r in ranks if phases else []:
        comms = len(trainer_comms(plan, g, r))
        for p in results[(g, r)]:
            a = allowances(0 if cpu else p.device, 0 if cpu else comms, context=not cpu)
            rows.append(Row(f"group {grp.name}", f"rank {base + r} ({_role(grp, r)})", p.name,
                            p.device + a.total, p.host, 0 if cpu else limit, 0, 0, p.device, a.context, a.nccl,
                            a.comms, a.fragmentation, trainer_remedy(cfg, grp, p.name)))
    per_node = -(-grp.ranks // max(grp.slurm.nodes, 1))
    parked = len(grp.agents) if len(grp.agents) > 1 else 0
    host = {r: max(p.total if cpu else p.host for p in results[(g, r)])
            + parked * results[(g, r)][-1].device_live for r in ranks}
    node = node_host(grp, per_node, host)
    rows.append(_node_row(f"group {grp.name}", base, per_node, "ranks", node, node_limit(cfg, comps[name])))
    rows[-1].remedy = (f"raise group {grp.name}'s slurm.mem or slurm.mem_per_gpu, or spread its {grp.ranks} "
                       f"ranks over more nodes (slurm.nodes {grp.slurm.nodes})")
    return rows


def node_host(grp: Group, per_node: int, host: dict[int, int]) -> int:
    """A node's host bytes from its checked ranks' (`host`: group rank -> bytes). A
    checkpoint save gathers the optimizer state on DP rank 0 (save_spike): a node of
    `per_node` ranks holds per_node / DP of those (megatron's order: TP fastest, then DP),
    each like the largest checked one (every stage's sender is one), and the rest like the
    largest checked rank of another DP rank (the last rank); with DP 1 every rank is one."""
    dp = grp.ranks // (grp.tensor_parallel * grp.pipeline_parallel)
    per_stage = grp.ranks // grp.pipeline_parallel
    zero = [v for r, v in host.items() if r % per_stage < grp.tensor_parallel]
    rest = [v for r, v in host.items() if r % per_stage >= grp.tensor_parallel] or zero
    n_zero = per_node if dp == 1 else -(-per_node // dp)
    return n_zero * max(zero) + (per_node - n_zero) * max(rest)


def trainer_remedy(cfg: Config, grp: Group, phase: str) -> str:
    """What would make a trainer rank's `phase` fit: states shrink with TP x PP, activations
    with recompute and a smaller micro-batch, the save's gather with DDP buckets, the send with
    the bucket."""
    states = (f"raise group {grp.name}'s tensor_parallel or pipeline_parallel (TP {grp.tensor_parallel} x "
              f"PP {grp.pipeline_parallel}: each rank holds 1/(TP x PP) of the states)")
    if phase == "train step":
        t = cfg.trainer
        if getattr(t, "recompute", "none") != "full":
            return f"turn on trainer.recompute: full (now {getattr(t, 'recompute', 'none')}), or " + states
        return (f"lower trainer.micro_batch_size ({t.micro_batch_size} -> {max(t.micro_batch_size // 2, 1)}) "
                f"or raise trainer.pipeline_microbatches ({t.pipeline_microbatches}), or " + states)
    if phase == "checkpoint save" and not cfg.trainer.overlap_grad_reduce:
        return ("turn on trainer.overlap_grad_reduce (the save gathers one DDP bucket at a time; without it the "
                "bucket is the rank's whole buffer), or " + states)
    if phase == "weight sync (send)":
        return f"lower weight_sync.bucket_mb ({cfg.weight_sync.bucket_mb:g}), or " + states
    return states


def _mem(nbytes: int) -> str:
    """A --mem in bytes as sbatch spells it (M = MiB, G = GiB) and in GB, the table's unit."""
    size = f"{nbytes // 2**30}G" if nbytes % 2**30 == 0 else f"{nbytes // 2**20}M"
    return f"{size} ({nbytes / GB:.1f} GB)"


def failures(rows: list[Row]) -> list[str]:
    """One line per rank over its device memory or node over its --mem, with its remedy."""
    out = []
    fix = lambda r: f"; remedy: {r.remedy}" if r.remedy else ""       # noqa: E731
    for r in rows:
        if r.device_limit and r.device_bytes > r.device_limit:
            out.append(f"{r.component} {r.rank}: {r.phase} needs {r.device_bytes / GB:.1f} GB of device "
                       f"memory, more than its {r.device_limit / GB:.0f} GB{fix(r)}")
        if r.node_limit and r.node_host_bytes > r.node_limit:
            out.append(f"{r.component} {r.rank}: {r.node_host_bytes / GB:.1f} GB of host memory, more than "
                       f"the node's --mem {_mem(r.node_limit)}{fix(r)}")
    return out


def table(rows: list[Row]) -> str:
    """Per component and rank: each phase's peak device GB (its tensors, then each allowance a
    GPU adds: CUDA context, NCCL communicators (count), fragmentation, config/gpu_memory.py;
    "-": inside vLLM's budget or not counted), host GB, and node totals."""
    lines = [f"{'component':16s} {'rank':34s} {'phase':30s} {'tensors':>8s} {'context':>8s} {'NCCL (n)':>10s} "
             f"{'frag':>5s} {'device GB':>10s} {'host GB':>8s}", "-" * 138]
    for r in rows:
        if r.phase != "node total":
            mark = "  OVER" if r.device_limit and r.device_bytes > r.device_limit else ""
            tensors = r.device_bytes if r.tensor_bytes < 0 else r.tensor_bytes
            gb = lambda v: f"{v / GB:.1f}" if v else "-"                       # noqa: E731
            nccl = f"{r.nccl / GB:.1f} ({r.comms})" if r.comms else "-"
            lines.append(f"{r.component:16s} {r.rank:34s} {r.phase:30s} {tensors / GB:8.1f} {gb(r.context):>8s} "
                         f"{nccl:>10s} {gb(r.fragmentation):>5s} {r.device_bytes / GB:10.1f} "
                         f"{r.host_bytes / GB:8.1f}{mark}")
        if r.node_host_bytes or r.phase == "node total":
            lim = f"--mem {_mem(r.node_limit)}" if r.node_limit else "--mem 0: whole node, unchecked"
            mark = "  OVER" if r.node_limit and r.node_host_bytes > r.node_limit else ""
            lines.append(f"{r.component:16s} {'node ' + r.rank.split(' (')[0] + ' is on':34s} "
                         f"{'node host total':30s} {'':>45s} {r.node_host_bytes / GB:8.1f}  ({lim}){mark}")
    return "\n".join(lines)


def memory_report(config: str, overrides: list[str], hardware: str, as_json: bool,
                  workers: int = 2, only: tuple[str, ...] = ()) -> tuple[str, int]:
    """What `simulate memory` prints, and its exit code: 0 when every rank and node fits,
    1 naming each that does not."""
    from flexmarl_hpc.config.load import load_plan
    from flexmarl_hpc.sim.hardware import load_hardware
    plan = load_plan(config, overrides)
    cfg, hw = plan.cfg, load_hardware(hardware)
    names = {p.name for p in plan.pools} | {g.name for g in plan.groups}
    if set(only) - names:
        raise ValueError(f"--only: no pool or group {sorted(set(only) - names)}; expected some of {sorted(names)}")
    rows = check_config(plan, hw.hbm_gb, workers, only)
    bad = failures(rows)
    if as_json:
        text = json_text(config, hw.name, rows, bad)
    else:
        head = (f"{config}: peak memory per rank and phase (fake tensors, real code; replicas: "
                f"{REPLICA_HEAD[cfg.rollout.backend == 'vllm']}), trainer device limit "
                f"{hw.hbm_gb:.0f} GB ({hw.name}), micro-batch {cfg.trainer.micro_batch_size}, "
                f"recompute {getattr(cfg.trainer, 'recompute', 'none')}")
        text = "\n".join([head, *allowance_lines(cfg), table(rows)] + send_peaks(rows)
                          + [f"not checked: {n}" for n in unchecked(plan, only)]
                          + [f"FAILS: {b}" for b in bad] + (["fits"] if not bad else []))
    return text, 1 if bad else 0


def allowance_lines(cfg: Config) -> list[str]:
    """The report's statement of each GPU allowance with its source, and each model's
    vocabulary with where it comes from."""
    from flexmarl_hpc.config import gpu_memory as gm
    from flexmarl_hpc.workflows.build import build_task
    task = build_task(cfg)
    vocab = {}
    for a in cfg.agent_names:
        m = cfg.model_for(a)
        src = f"{m.checkpoint}/config.json" if m.checkpoint else "the task's tokenizer"
        vocab.setdefault((model_args(cfg, task, a).vocab_size, src), []).append(a)
    return [f"GPU allowances: CUDA context {gm.CUDA_CONTEXT_BYTES / GB:.2f} GB a process (pytorch#86509, eager "
            f"loading); NCCL {gm.nccl_comm_bytes() / GB:.2f} GB a communicator (max of {gm.NCCL_CHANNELS} "
            f"channels x {gm.NCCL_RING_PEERS} ring peers x (NCCL_BUFFSIZE 4 MiB + LL128 4.69 MiB + LL 0.5 MiB) and "
            f"688 MB measured, NVIDIA/nccl#964); fragmentation {gm.FRAGMENTATION:.0%} of the tensors "
            "(an allowance, to be measured on a GPU)"] + \
        [f"vocabulary {v:,} ({src}): {', '.join(names)}" for (v, src), names in vocab.items()]


def send_peaks(rows: list[Row]) -> list[str]:
    """Per group, the largest weight-sync send over its stage senders (the first stage's
    sends the embedding, the last's the LM head), naming the rank."""
    out = []
    for comp in dict.fromkeys(r.component for r in rows):
        sends = [r for r in rows if r.component == comp and r.phase == "weight sync (send)"]
        if sends:
            top = max(sends, key=lambda r: r.device_bytes)
            out.append(f"{comp}: weight sync send peak {top.device_bytes / GB:.1f} GB, the largest of "
                       f"{len(sends)} stage sender(s), {top.rank}")
    return out


def unchecked(plan: Plan, only: tuple[str, ...] = ()) -> list[str]:
    """The groups the check skips: it runs megatron trainers (and every pool's replicas:
    torch engines run, vLLM's accounted)."""
    return [f"group {g.name} (backend {g.backend})" for g in plan.groups
                  if g.backend != "megatron" and (not only or g.name in only)]


def json_text(config: str, hardware: str, rows: list[Row], bad: list[str]) -> str:
    import json
    return json.dumps({"config": config, "hardware": hardware, "rows": [dataclasses.asdict(r) for r in rows],
                       "failures": bad, "fits": not bad}, indent=1)
