"""megatron-core trainer backend: GPTModel with TP/PP/DP inside one trainer group.

The only module that imports megatron. Each trainer group is its own torch.distributed
world (gloo on CPU, NCCL on GPU) over exactly the group's ranks, rendezvoused through the
group's MPI communicator (the leader opens a TCPStore on a free port and broadcasts it), so
several agents' groups coexist in one MPI job and megatron's `parallel_state` only sees its
group: TP x PP x DP = trainer.ranks_per_group. The model is Llama/Qwen2-style (RMSNorm,
SwiGLU, RoPE with base rope_theta, GQA, tied or untied embeddings, biases only on QKV when
qkv_bias): megatron's local layer spec on CPU (through flexmarl_hpc.megatron_compat), the
Transformer Engine spec where TE is installed on a GPU. It is wrapped in megatron's DDP with
the DistributedOptimizer (Adam; torch's AdamW on CPU). The loss is flexmarl_hpc.grpo's, on
logits gathered over TP, so both backends optimise the same function.

Contract (same as TorchTrainer; tests/test_megatron.py checks it against TorchTrainer):
- `forward_backward(mb, scale)`: `mb` is this rank's share as the runtime cuts it
  (rows rank::size of the micro-batch). With TP or PP the group re-forms the micro-batch
  (a small allgather of token ids) and each data-parallel replica takes its rows. Gradients
  of scale * sum-of-sample-losses accumulate. The returned stats have the same keys on every
  rank and sum over the group to the micro-batch totals.
- `optimizer_step()`: DP reduce-scatter + TP/PP reductions, clip, Adam step, param
  all-gather; then the HF weights are gathered to the group leader, so `named_weights()`
  is local (the runtime calls it on the leader only).
- `state()` / `load_state()`: HF-named full tensors in TorchTrainer's format
  (model.<hf name>, optim.<i>.{step,exp_avg,exp_avg_sq} with i the parameter index in HF
  order, version, rng), independent of TP/PP/DP: a state moves between groups of other
  layouts and between the torch and megatron backends. `state()` is collective (every group
  rank calls it; each gets the full state), `load_state()` is called by every rank.
  Meant for small models: at scale use `save_checkpoint`/`load_checkpoint`.
- `save_checkpoint(dir)` / `load_checkpoint(dir)`: megatron dist_checkpointing of model and
  optimizer (fully reshardable format): a checkpoint saved with one TP/PP/DP layout loads
  into another. Collective.

    trainer: {backend: megatron, ranks_per_group: 4, tensor_parallel: 2, pipeline_parallel: 1}
"""
from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import pickle
import socket
import warnings
from datetime import timedelta
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

from .. import comm as C
from ..config import TrainerConfig
from ..convert import hf_to_megatron, megatron_to_hf, padded_vocab
from ..grpo import MicroBatch, grpo_loss, token_logprobs
from ..model import ModelArgs, build_model, hf_state_dict

_LAYOUT: tuple[int, int, int] | None = None      # (group size, tp, pp) this process runs
# megatron warns on every rank, at import and at each build, that Apex / Transformer Engine
# are absent and that it falls back to torch (expected on CPU), and torch.distributed calls
# it makes are deprecated; a 4-rank job printed 30 such lines before its first step
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.c10d_logger",
                        message=r".*is deprecated")
_CUDA = torch.cuda.is_available()
# megatron's TE spec fuses the pre-attention / pre-MLP norms into the next linear
_TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def _scope():
    """Where megatron runs: on CPU inside megatron_compat's device mode."""
    if _CUDA:
        return contextlib.nullcontext()
    from .. import megatron_compat
    return megatron_compat.cpu_mode()


# -- MPI helpers (non-spinning, see comm.py) -------------------------------------------------
def _allgather_bytes(group: MPI.Comm, data: bytes) -> list[bytes]:
    n = np.array([len(data)], dtype=np.int64)
    sizes = np.zeros(group.Get_size(), dtype=np.int64)
    C.wait(group.Iallgather(n, sizes))
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    C.wait(group.Iallgatherv(np.frombuffer(data, dtype=np.uint8), [out, sizes, offs, MPI.BYTE]))
    return [out[o:o + s].tobytes() for o, s in zip(offs, sizes)]


def _gather_bytes(group: MPI.Comm, data: bytes, root: int = 0) -> list[bytes] | None:
    n = np.array([len(data)], dtype=np.int64)
    sizes = np.zeros(group.Get_size(), dtype=np.int64)
    C.wait(group.Igather(n, sizes, root=root))
    me = group.Get_rank() == root
    out = np.empty(int(sizes.sum()) if me else 0, dtype=np.uint8)
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    C.wait(group.Igatherv(np.frombuffer(data, dtype=np.uint8),
                          [out, sizes, offs, MPI.BYTE] if me else None, root=root))
    return [out[o:o + s].tobytes() for o, s in zip(offs, sizes)] if me else None


def _tensors_to_bytes(d: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save
    return save({k: v.detach().to("cpu").contiguous() for k, v in d.items()}) if d else b""


def _tensors_from_bytes(b: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load
    return load(b) if b else {}


# -- process-wide set-up ----------------------------------------------------------------------
def _local_rank(group: MPI.Comm) -> int:
    for var in ("SLURM_LOCALID", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return group.Get_rank()


def init_group_distributed(group: MPI.Comm, tp: int, pp: int, relayout: bool = False) -> None:
    """torch.distributed and megatron's parallel_state over exactly this group's ranks.
    Once per process (a rank belongs to one trainer group); later trainers of the same
    layout (other agents on this group) reuse it. `relayout=True` rebuilds parallel_state
    for another TP/PP split of the same ranks (trainers of the old layout become invalid;
    tests use it to reshard checkpoints in one job)."""
    global _LAYOUT
    key = (group.Get_size(), tp, pp)
    if _LAYOUT is not None:
        if _LAYOUT == key:
            return
        if not relayout or _LAYOUT[0] != key[0]:
            raise RuntimeError(f"this process already runs megatron as (ranks, tp, pp) = {_LAYOUT}, not {key}")
        from megatron.core import parallel_state
        with _scope():
            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                                     pipeline_model_parallel_size=pp)
            with torch.random.fork_rng(devices=[]):
                from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
                model_parallel_cuda_manual_seed(1234)
        _LAYOUT = key
        return
    if group.Get_size() % (tp * pp):
        raise ValueError(f"trainer.ranks_per_group={group.Get_size()} is not a multiple of "
                         f"tensor_parallel x pipeline_parallel = {tp * pp}")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    if _CUDA:
        torch.cuda.set_device(_local_rank(group) % torch.cuda.device_count())
    else:
        from .. import megatron_compat
        megatron_compat.apply()
    rank, size = group.Get_rank(), group.Get_size()
    timeout = timedelta(minutes=30)
    store = None
    if rank == 0:
        # port 0: the OS picks a free port, no race with other groups' leaders on this node
        store = torch.distributed.TCPStore("0.0.0.0", 0, size, is_master=True, timeout=timeout,
                                           wait_for_workers=False)
        where = (socket.gethostname(), store.port)
    else:
        where = None
    host, port = C.bcast_obj(group, where, 0)
    if rank != 0:
        addr = "127.0.0.1" if host == socket.gethostname() else host
        store = torch.distributed.TCPStore(addr, port, size, is_master=False, timeout=timeout)
    torch.distributed.init_process_group("nccl" if _CUDA else "gloo", store=store, rank=rank,
                                         world_size=size, timeout=timeout)
    atexit.register(_shutdown_distributed, group)
    with _scope():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                                 pipeline_model_parallel_size=pp)
        with torch.random.fork_rng(devices=[]):      # keep the caller's CPU RNG stream
            model_parallel_cuda_manual_seed(1234)
    _LAYOUT = key


def _shutdown_distributed(group: MPI.Comm) -> None:
    """Tear torch.distributed down before the interpreter does: left to static destructors,
    the TCPStore server thread of the group leader (or gloo's) can still be joinable when
    the process exits, and C++ calls std::terminate (seen as a rank aborting with signal 6
    after all its work was done). Runs from atexit, before mpi4py finalizes MPI, so the
    group can still agree that every rank is past its last collective."""
    global _LAYOUT
    if not torch.distributed.is_initialized():
        return
    from megatron.core import parallel_state
    C.barrier(group)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    _LAYOUT = None


def transformer_config(args: ModelArgs, cfg: TrainerConfig):
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_heads,
        num_query_groups=args.num_kv_heads, ffn_hidden_size=args.intermediate_size,
        kv_channels=args.head_dim, normalization="RMSNorm", layernorm_epsilon=args.rms_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=args.qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=cfg.tensor_parallel, pipeline_model_parallel_size=cfg.pipeline_parallel,
        pipeline_dtype=torch.float32, params_dtype=torch.float32,
        # the weights come from `init` right after construction, but megatron's init also tags
        # TP-sharded parameters (tensor_model_parallel, ...), which grad-norm and checkpoints
        # rely on: keep it (under fork_rng, so the caller's RNG stream is untouched)
        perform_initialization=True, use_cpu_initialization=not _CUDA,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False)


def _use_te() -> bool:
    if not _CUDA:
        return False
    try:
        import transformer_engine  # noqa: F401
        return True
    except ImportError:
        return False


def _layer_spec():
    from megatron.core.models.gpt import gpt_layer_specs as specs
    if _use_te():
        return specs.get_gpt_layer_with_transformer_engine_spec()
    return specs.get_gpt_layer_local_spec(normalization="RMSNorm")


class MegatronTrainer:
    def __init__(self, args: ModelArgs, cfg: TrainerConfig, group: MPI.Comm, temperature: float,
                 init: dict[str, torch.Tensor] | None = None):
        if cfg.kl_coef > 0:
            raise NotImplementedError("trainer.kl_coef > 0 (a frozen reference model) is not "
                                      "implemented for the megatron backend; use trainer.backend=torch")
        init_group_distributed(group, cfg.tensor_parallel, cfg.pipeline_parallel)
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        self.args, self.cfg, self.group, self.temperature = args, cfg, group, temperature
        self.tp, self.pp = cfg.tensor_parallel, cfg.pipeline_parallel
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dp_rank, self.dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.te = _use_te()
        self.version = 0
        if init is None:
            init = hf_state_dict(build_model(args, seed=0))
        with _scope(), torch.random.fork_rng(devices=[]):
            self.tconfig = transformer_config(args, cfg)
            model = GPTModel(config=self.tconfig, transformer_layer_spec=_layer_spec(),
                             vocab_size=padded_vocab(args),
                             max_sequence_length=args.max_seq_len,
                             pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                             share_embeddings_and_output_weights=args.tie_embeddings,
                             position_embedding_type="rope", rotary_base=args.rope_theta)
            if _CUDA:
                model.cuda(torch.cuda.current_device())
            self._load_weights(model, init)
            self.model = DistributedDataParallel(
                config=self.tconfig, module=model,
                ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                                         overlap_grad_reduce=False, overlap_param_gather=False))
            self.opt = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.betas[0],
                adam_beta2=cfg.betas[1], adam_eps=1e-8, clip_grad=cfg.grad_clip,
                use_distributed_optimizer=True, params_dtype=torch.float32), [self.model])
        self._stat_keys = tuple(_zero_stats())
        self._named: dict[str, torch.Tensor] = {}
        self._refresh_named()

    # -- weights in and out (HF names) ---------------------------------------------------
    @property
    def leader(self) -> bool:
        return self.group.Get_rank() == 0

    def _to_local(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Converter (local-spec) names -> this model's names."""
        if not self.te:
            return sd
        out = {}
        for k, v in sd.items():
            for a, b in _TE_NAMES.items():
                if k.endswith(a):
                    k = k[: -len(a)] + b
            out[k] = v
        return out

    def _from_local(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.te:
            return sd
        out = {}
        for k, v in sd.items():
            for a, b in _TE_NAMES.items():
                if k.endswith(b):
                    k = k[: -len(b)] + a
            out[k] = v
        return out

    def _load_weights(self, module, hf: dict[str, torch.Tensor]) -> None:
        shard = self._to_local(hf_to_megatron(hf, self.args, self.tp_rank, self.tp, self.pp_rank, self.pp))
        missing, unexpected = module.load_state_dict(shard, strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"megatron shard mismatch: missing {missing[:4]}, unexpected {unexpected[:4]}")

    def _local_params(self) -> dict[str, torch.nn.Parameter]:
        """This rank's parameters by converter name (TP shard of its PP stage)."""
        named = dict(self.model.module.named_parameters())
        return self._from_local(named)

    def _gather_hf(self, local: dict[str, torch.Tensor], to_all: bool) -> dict[str, torch.Tensor]:
        """HF tensors from every (pp, tp) shard of DP replica 0 (`local`: converter-named
        tensors of this rank): on the leader, or on every rank with `to_all`."""
        if self.group.Get_size() == 1:
            return megatron_to_hf([[local]], self.args)
        # DP replicas hold identical copies: replica 0 sends, the others send a header only
        head = np.array([self.pp_rank, self.tp_rank, self.dp_rank], dtype=np.int64).tobytes()
        blobs = _gather_bytes(self.group, head + (_tensors_to_bytes(local) if self.dp_rank == 0 else b""), 0)
        hf: dict[str, torch.Tensor] = {}
        if self.leader:
            grid = [[None] * self.tp for _ in range(self.pp)]
            for b in blobs:
                pp, tp, dp = np.frombuffer(b[:24], dtype=np.int64).tolist()
                if dp == 0:
                    grid[pp][tp] = _tensors_from_bytes(b[24:])
            hf = megatron_to_hf(grid, self.args)
        if to_all:
            hf = _tensors_from_bytes(C.bcast_obj(self.group, _tensors_to_bytes(hf) if self.leader else None, 0))
        return hf

    def _refresh_named(self) -> None:
        local = {k: p.detach() for k, p in self._local_params().items()}
        self._named = self._gather_hf(local, to_all=False)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """HF-named full weights (on the group leader; gathered after every step, so this
        call is local)."""
        return self._named

    # -- training ------------------------------------------------------------------------
    def _dp_share(self, mb: MicroBatch) -> MicroBatch:
        size = self.group.Get_size()
        if self.tp * self.pp == 1:
            return mb                                 # pure DP: the runtime's rows are ours
        shares = [pickle.loads(b) for b in _allgather_bytes(self.group, pickle.dumps(mb))]
        n = sum(len(s) for s in shares)
        full = {}
        for f in MicroBatch.__dataclass_fields__:
            parts = [getattr(s, f) for s in shares]
            if parts[0] is None:
                full[f] = None
                continue
            t = parts[0].new_empty((n, *parts[0].shape[1:]))
            for r, p in enumerate(parts):
                t[r::size] = p
            full[f] = t
        return MicroBatch(**full).shard(self.dp_rank, self.dp)

    def forward_backward(self, mb: MicroBatch, scale: float) -> dict[str, float]:
        mb = self._dp_share(mb)
        stats = dict.fromkeys(self._stat_keys, 0.0)
        if len(mb) == 0:
            return stats
        from megatron.core.pipeline_parallel import get_forward_backward_func
        out: dict[str, float] = {}
        B, T = mb.input_ids.shape
        with _scope():
            get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, mb=mb, scale=scale, out=out),
                data_iterator=iter([mb]), model=[self.model], num_microbatches=1, seq_length=T,
                micro_batch_size=B, forward_only=False)
        if self.tp_rank == 0 and self.pp_rank == self.pp - 1:
            stats.update(out)                          # one report per data-parallel replica
        return stats

    def _logits(self, model, mb: MicroBatch):
        B, T = mb.input_ids.shape
        dev = torch.cuda.current_device() if _CUDA else "cpu"
        ids = mb.input_ids.to(dev)
        pos = torch.arange(T, device=dev).expand(B, T)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=dev), 1)[None, None]
        return model(ids, pos, causal.expand(B, 1, T, T))

    def _full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
        return gather_from_tensor_model_parallel_region(logits)[..., :self.args.vocab_size].float().cpu()

    def _forward_step(self, data_iterator, model, mb: MicroBatch, scale: float, out: dict):
        next(data_iterator)
        output = self._logits(model, mb)

        def loss_func(logits):
            logp, ent = token_logprobs(self._full_logits(logits), mb, self.temperature)
            loss, stats = grpo_loss(logp, ent, mb, clip_eps=self.cfg.clip_eps,
                                    entropy_coef=self.cfg.entropy_coef, tis_cap=self.cfg.tis_cap)
            out.update(stats)
            # megatron's DDP averages gradients over data-parallel ranks; our 1/N scale
            # (N = global batch) wants their sum
            return loss * (scale * self.dp), {}
        return output, loss_func

    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits [B, T, V] of a forward pass (collective over the group;
        the same ids on every rank). Returned on the last pipeline stage, None elsewhere."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        B, T = input_ids.shape
        mb = MicroBatch(input_ids, torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long),
                        torch.zeros(B, T), torch.zeros(B), torch.zeros(B, dtype=torch.bool), None)
        got: list[torch.Tensor] = []

        def step(data_iterator, model):
            next(data_iterator)

            def keep(logits):
                got.append(self._full_logits(logits).detach())
                return logits.sum() * 0, {}
            return self._logits(model, mb), keep
        with _scope(), torch.no_grad():
            get_forward_backward_func()(forward_step_func=step, data_iterator=iter([mb]), model=[self.model],
                                        num_microbatches=1, seq_length=T, micro_batch_size=B, forward_only=True)
        return got[0] if got else None

    def optimizer_step(self) -> dict[str, float]:
        from megatron.core.distributed import finalize_model_grads
        with _scope():
            finalize_model_grads([self.model])
            ok, grad_norm, _ = self.opt.step()
            self.model.zero_grad_buffer()
            self.opt.zero_grad()
        if not ok:
            raise RuntimeError("megatron optimizer step was skipped (non-finite gradients)")
        self.version += 1
        self._refresh_named()
        return {"grad_norm": float(grad_norm or 0.0)}

    # -- optimizer state in HF layout ---------------------------------------------------------
    def _dist_optimizers(self):
        return getattr(self.opt, "chained_optimizers", [self.opt])

    def _opt_slot(self, param):
        """(its main-param shard, that shard's Adam state, Range in the flat param) on this
        DP rank, or None where the DistributedOptimizer gave this rank no part of it."""
        for o in self._dist_optimizers():
            if param in o.model_param_group_index_map:
                gi, go = o.model_param_group_index_map[param]
                main = o.optimizer.param_groups[gi]["params"][go]
                return main, o.optimizer.state[main], o._get_model_param_range_map(param)["param"]
        return None

    def _step_of(self, main, st) -> float:
        if "step" in st:
            return float(st["step"])
        for o in self._dist_optimizers():
            for g in o.optimizer.param_groups:
                if any(p is main for p in g["params"]):
                    return float(g.get("step", 0))
        return 0.0

    def _local_moments(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
        """exp_avg / exp_avg_sq of this rank's (TP, PP) parameter shards, assembled over the
        DP ranks that each hold a range of them, and the Adam step count."""
        from megatron.core import parallel_state as ps
        m1, m2, step = {}, {}, 0.0
        for name, p in self._local_params().items():
            slot = self._opt_slot(p)
            a = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            b = torch.zeros_like(a)
            if slot is not None and "exp_avg" in slot[1]:
                main, st, rng = slot
                a[rng.start:rng.end] = st["exp_avg"].view(-1)
                b[rng.start:rng.end] = st["exp_avg_sq"].view(-1)
                step = max(step, self._step_of(main, st))
            m1[name], m2[name] = a.view_as(p), b.view_as(p)
        if self.dp > 1:
            flat = torch.cat([t.view(-1) for t in (*m1.values(), *m2.values())] + [torch.tensor([step], device=a.device)])
            steps = flat[-1:].clone()
            with _scope():
                torch.distributed.all_reduce(flat, group=ps.get_data_parallel_group())
                torch.distributed.all_reduce(steps, op=torch.distributed.ReduceOp.MAX,
                                             group=ps.get_data_parallel_group())
            off = 0
            for d in (m1, m2):
                for k, t in d.items():
                    d[k] = flat[off:off + t.numel()].view_as(t)
                    off += t.numel()
            step = float(steps)
        return m1, m2, step

    def state(self) -> dict[str, torch.Tensor]:
        """Full HF-layout training state, TorchTrainer's format. Collective over the group."""
        weights = {k: p.detach() for k, p in self._local_params().items()}
        m1, m2, step = self._local_moments()
        hf = self._gather_hf(weights, to_all=True)
        hf1 = self._gather_hf(m1, to_all=True)
        hf2 = self._gather_hf(m2, to_all=True)
        order = _param_order(self.args)
        out = {f"model.{k}": hf[k] for k in order}
        if self.args.tie_embeddings:              # as CausalLM.state_dict() has it
            out["model.lm_head.weight"] = hf["model.embed_tokens.weight"]
        if step > 0:
            for i, k in enumerate(order):
                out[f"optim.{i}.step"] = torch.tensor(step)
                out[f"optim.{i}.exp_avg"] = hf1[k]
                out[f"optim.{i}.exp_avg_sq"] = hf2[k]
        out["version"] = torch.tensor(self.version)
        rng = torch.get_rng_state()
        out["rng"] = _tensors_from_bytes(C.bcast_obj(self.group, _tensors_to_bytes({"r": rng}), 0))["r"]
        return out

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of `state` (any layout's, or TorchTrainer's). Every group rank calls it."""
        hf = {k[6:]: v for k, v in state.items() if k.startswith("model.")}
        names = _param_order(self.args)
        with _scope():
            with torch.no_grad():
                self._load_weights(self.model.module, hf)
            if any(k.startswith("optim.") for k in state):
                m1 = {n: state[f"optim.{i}.exp_avg"] for i, n in enumerate(names)}
                m2 = {n: state[f"optim.{i}.exp_avg_sq"] for i, n in enumerate(names)}
                step = float(state[f"optim.0.step"])
                s1 = hf_to_megatron(m1, self.args, self.tp_rank, self.tp, self.pp_rank, self.pp)
                s2 = hf_to_megatron(m2, self.args, self.tp_rank, self.tp, self.pp_rank, self.pp)
                for name, p in self._local_params().items():
                    slot = self._opt_slot(p)
                    if slot is None:
                        continue
                    main, st, rng = slot
                    st["exp_avg"] = s1[name].reshape(-1)[rng.start:rng.end].to(main).view_as(main).clone()
                    st["exp_avg_sq"] = s2[name].reshape(-1)[rng.start:rng.end].to(main).view_as(main).clone()
                    if _torch_adam():
                        st["step"] = torch.tensor(step, dtype=torch.float32)
                if not _torch_adam():           # TE/apex FusedAdam count steps per group
                    for o in self._dist_optimizers():
                        for g in o.optimizer.param_groups:
                            g["step"] = int(step)
            else:
                for o in self._dist_optimizers():
                    o.optimizer.state.clear()
        self.version = int(state["version"])
        torch.set_rng_state(state["rng"])
        self._refresh_named()

    # -- checkpoints (dist_checkpointing: any TP/PP/DP layout loads them) --------------------
    _META = {"distrib_optim_sharding_type": "fully_reshardable"}

    def _sharded(self, loading: bool):
        model_sd = self.model.module.sharded_state_dict()
        opt_sd = self.opt.sharded_state_dict(model_sd, is_loading=loading, metadata=self._META)
        return {"model": model_sd, "optimizer": opt_sd}

    def save_checkpoint(self, folder: str | Path) -> None:
        """Collective: every group rank writes its shards of model and optimizer."""
        from megatron.core import dist_checkpointing
        _fork_only_writer_queue()
        folder = Path(folder)
        if self.leader:
            folder.mkdir(parents=True, exist_ok=True)
        C.barrier(self.group)
        with _scope():
            self._zero_optimizer_states()          # the format wants every state tensor
            dist_checkpointing.save(self._sharded(loading=False), str(folder), content_metadata=self._META)
        if self.leader:
            (folder / "flexmarl.json").write_text(json.dumps({"version": self.version}))
        C.barrier(self.group)

    def load_checkpoint(self, folder: str | Path) -> None:
        """Collective; the checkpoint may come from another TP/PP/DP layout."""
        from megatron.core import dist_checkpointing
        folder = Path(folder)
        meta = json.loads((folder / "flexmarl.json").read_text())
        with _scope():
            self._zero_optimizer_states()
            for o in self._dist_optimizers():
                _tolerate_torch_adam_step(o)
            loaded = dist_checkpointing.load(self._sharded(loading=True), str(folder))
            self.model.module.load_state_dict(loaded["model"], strict=False)
            self.opt.load_state_dict(loaded["optimizer"])
        self.version = int(meta["version"])
        self._refresh_named()

    def _zero_optimizer_states(self) -> None:
        """Adam states at zero (no update: unlike megatron's dummy step, which would apply
        weight decay)."""
        for o in self._dist_optimizers():
            for g in o.optimizer.param_groups:
                for main in g["params"]:
                    st = o.optimizer.state[main]
                    if "exp_avg" not in st:
                        if _torch_adam():
                            st["step"] = torch.tensor(0.0)
                        st["exp_avg"] = torch.zeros_like(main)
                        st["exp_avg_sq"] = torch.zeros_like(main)


def _torch_adam() -> bool:
    """megatron fell back to torch's AdamW (no TE/apex: CPU)."""
    from megatron.core import optimizer as mo
    return bool(getattr(mo, "USING_PYTORCH_OPTIMIZER", not _CUDA))


def _tolerate_torch_adam_step(opt) -> None:
    """megatron-core 0.16 with torch's AdamW (no TE/apex): loading a sharded optimizer state
    adds the per-parameter "step" to the destination but not to the loaded tensors and then
    copies key by key (KeyError: 'step'). The step itself is restored from the param groups;
    copy what was loaded."""
    def set_states(model_param, tensors):
        dst = opt._get_main_param_and_optimizer_states(model_param)
        for k, v in tensors.items():
            dst[k].copy_(v)
    opt._set_main_param_and_optimizer_states = set_states


def _fork_only_writer_queue() -> None:
    """dist_checkpointing's writer collects results through a multiprocessing Manager that it
    starts with the *spawn* method; a spawned child re-imports the MPI program's main module,
    initialises MPI and dies (PMI_Init failed). A forked manager inherits the process and never
    touches MPI (forked children leave through os._exit, so no MPI_Finalize runs there)."""
    import multiprocessing as mp
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    except ImportError:
        return
    if getattr(fa, "_results_queue", "absent") is None:
        fa._results_queue = mp.get_context("fork").Manager().Queue()


def _param_order(args: ModelArgs) -> list[str]:
    """HF names in CausalLM.parameters() order: TorchTrainer's optimizer indices."""
    from ..model import CausalLM
    with torch.device("meta"):
        return [n for n, _ in CausalLM(args).named_parameters()]


def _zero_stats() -> dict[str, float]:
    """grpo_loss's stat keys (computed, so they follow grpo.py), all zero."""
    z = torch.zeros(1, 2)
    mb = MicroBatch(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, dtype=torch.long),
                    torch.ones(1, dtype=torch.long), z, torch.zeros(1), torch.zeros(1, dtype=torch.bool), None)
    _, stats = grpo_loss(z, z, mb, clip_eps=0.2, entropy_coef=0.0, tis_cap=1.0)
    return dict.fromkeys(stats, 0.0)
