"""MegatronTrainer: GPTModel (+ Float16Module for bf16) in megatron's DDP with the
DistributedOptimizer, trained by megatron's forward-backward schedule (1F1B over several
micro-batches when PP > 1), with the GRPO loss computed vocab-parallel on the TP ranks."""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import replace
from functools import partial
from typing import Mapping, Sequence

import numpy as np
import torch
from mpi4py import MPI

from flexmarl_hpc.config.schema import TrainerConfig
from flexmarl_hpc.learn.convert import hf_row_sources, padded_vocab, sync_order
from flexmarl_hpc.learn.grpo import MicroBatch, grpo_loss, stat_values, vocab_parallel_logprobs
from flexmarl_hpc.learn.model import ModelArgs
from flexmarl_hpc.learn.weights import WeightSource
from flexmarl_hpc.runtime.weight_sync import Allocate
from flexmarl_hpc.trainer.megatron import configs
from flexmarl_hpc.trainer.megatron.dist import allgather_bytes, device, init_group_distributed, scope
from flexmarl_hpc.trainer.megatron.dist_ckpt import DistCheckpoint
from flexmarl_hpc.trainer.megatron.hf_state import HFState
from flexmarl_hpc.trainer.megatron.swap import Swap


class MegatronTrainer(HFState, DistCheckpoint, Swap):
    def __init__(self, args: ModelArgs, cfg: TrainerConfig, group: MPI.Comm, temperature: float,
                 init: dict[str, torch.Tensor] | WeightSource | None = None):
        """`init`: version 0, full HF tensors (tests, small models) or a WeightSource, read
        as this rank's shard only (HF checkpoint slices, or a seeded random init; None:
        random init with seed 0)."""
        if cfg.kl_coef > 0 and cfg.pipeline_parallel > 1:
            raise NotImplementedError("trainer.kl_coef > 0 with trainer.pipeline_parallel > 1: the frozen "
                                      "reference model would need its own pipeline pass; use "
                                      "pipeline_parallel=1 (TP and DP are supported)")
        init_group_distributed(group, cfg.tensor_parallel, cfg.pipeline_parallel,
                               timeout_s=cfg.collective_timeout_s)
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.models.gpt import GPTModel
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module
        self.args, self.cfg, self.group, self.temperature = args, cfg, group, temperature
        self.tp, self.pp = cfg.tensor_parallel, cfg.pipeline_parallel
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dp_rank, self.dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        # the group's first rank says it when a GPU run falls back to the local layer spec
        notify = (lambda line: print(line, file=sys.stderr, flush=True)) if group.Get_rank() == 0 else None
        self.te, self.bf16 = configs.use_te(notify=notify), configs.resolve_precision(cfg) == "bf16"
        self.microbatches = configs.pipeline_microbatches(cfg)
        self.version, self.opt = 0, None
        self.kept: list[tuple[list[MicroBatch], int, float]] = []   # this batch (ppo_epochs > 1)
        self.timeline: list[tuple[str, int, float, float]] | None = None   # set to a list to record
        with scope(), torch.random.fork_rng(devices=[]):
            self.tconfig = configs.transformer_config(args, cfg)

            def gpt():
                m = GPTModel(config=self.tconfig, transformer_layer_spec=configs.layer_spec(self.te),
                             vocab_size=padded_vocab(args), max_sequence_length=args.max_seq_len,
                             pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                             share_embeddings_and_output_weights=args.tie_embeddings,
                             position_embedding_type="rope", rotary_base=args.rope_theta)
                return m.cuda(torch.cuda.current_device()) if torch.cuda.is_available() else m
            self.gpt = gpt()
            module = Float16Module(self.tconfig, self.gpt) if self.bf16 else self.gpt
            shard = self._init_shard(init)
            self._load_shard(shard)
            # kl_coef > 0: a frozen copy of the initial weights, sharded like the policy (TP),
            # as TorchTrainer's reference model (not in the state: it is `init` again on resume)
            self.ref = None
            if cfg.kl_coef > 0:
                ref = gpt()
                ref.load_state_dict(self._module_names(shard), strict=False)
                ref.requires_grad_(False).eval()
                self.ref = Float16Module(self.tconfig, ref) if self.bf16 else ref
            self.model = DistributedDataParallel(config=self.tconfig, module=module,
                                                 ddp_config=configs.ddp_config(cfg))
            self.opt = get_megatron_optimizer(configs.optimizer_config(cfg), [self.model])
            self._load_shard(shard)                    # fp32 main params exactly from `init`
        del shard
        self._stat_keys = tuple(_zero_stats())
        # (pp, tp, dp) of every group rank: the senders of a weight sync, one per PP stage
        coords = [tuple(np.frombuffer(b, dtype=np.int64)) for b in allgather_bytes(
            group, np.array([self.pp_rank, self.tp_rank, self.dp_rank], dtype=np.int64).tobytes())]
        self._senders = [coords.index((s, 0, 0)) for s in range(self.pp)]

    def _init_shard(self, init) -> dict[str, torch.Tensor]:
        if isinstance(init, dict):
            return self._shard_of(init)
        return (init or WeightSource()).shard(self.args, self.tp_rank, self.tp, self.pp_rank, self.pp,
                                             device=device())

    @property
    def leader(self) -> bool:
        return self.group.Get_rank() == 0

    def named_weights(self) -> dict[str, torch.Tensor]:
        """HF-named full weights (fp32) on the group leader, {} elsewhere. Collective, and
        the whole model on one rank: for tests, export and one-rank groups; a sync streams
        (`sync_stream`) and never calls it."""
        with self.onloaded():
            return self._gather_hf({k: p.detach() for k, p in self._local_params().items()}, to_all=False)

    # -- weight sync (runtime/weight_sync.py): streamed, only when one is due -------------
    def sync_layouts(self) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
        """Per PP stage, the (HF name, shape, dtype) of what `sync_stream` yields there."""
        dt = torch.bfloat16 if self.bf16 else torch.float32
        return [[(hf, shape, dt) for _, outs in sync_order(self.args, self.tp, s, self.pp) for hf, shape in outs]
                for s in range(self.pp)]

    def sync_senders(self) -> list[int]:
        """Group rank of each PP stage's sender: its TP rank 0 of data-parallel replica 0."""
        return self._senders

    def sync_stream(self, pieces: Mapping[str, Sequence[tuple[int, int]]] | None = None,
                    dest: Allocate | None = None):
        """Collective over the group: each HF tensor of this rank's stage, or each row range
        of it that `pieces` names (the plan's pieces of a tensor larger than a bucket,
        weight_sync.row_pieces), assembled on the device of the stage's sender from the TP
        shards holding those rows (convert.hf_row_sources) and yielded there. `dest` (the
        same on every rank) says where: a sync's weight_sync.Destination assembles each range
        in place in the bucket being filled, at the wire dtype, so the sender holds its two
        bucket buffers and nothing more; the default (Allocate) a new tensor per range (tests,
        export). Never a whole parameter (a 1.3 GB embedding with 64 MiB buckets: 64 MiB at a
        time); the other TP ranks send views of their shard (cast to the wire dtype where it
        differs). Other data-parallel replicas hold the same weights and take no part."""
        if self.dp_rank != 0:
            return
        pieces, dest = pieces or {}, dest or Allocate()
        local = self._local_params()
        for name, outs in sync_order(self.args, self.tp, self.pp_rank, self.pp):
            p = local[name].detach()
            for hf, shape in outs:
                for first, stop in pieces.get(hf) or [(0, shape[0])]:
                    rows = self._hf_rows(p, hf, hf_row_sources(name, hf, self.args, self.tp, first, stop),
                                         (stop - first, *shape[1:]), dest)
                    if rows is not None:
                        yield hf, rows
                    del rows                   # before the next range is gathered

    def _hf_rows(self, p: torch.Tensor, hf: str, sources, shape: tuple[int, ...],
                 dest: Allocate) -> torch.Tensor | None:
        """HF rows from their `sources` in the TP shards of `p`, on TP rank 0 in `dest.rows`
        (point to point from each rank holding some: no rank sends what rank 0 does not need;
        whole rows land in place, a column block through `dest.scratch`); None on the other TP
        ranks, which send their parts in `dest.dtype`."""
        from megatron.core import parallel_state as ps
        group = ps.get_tensor_model_parallel_group() if self.tp > 1 else None
        dt = dest.dtype(hf, p.dtype)
        with scope():
            if self.tp_rank != 0:
                for w in [torch.distributed.isend(p[s.lo:s.hi].to(dt), group=group, group_dst=0)
                          for s in sources if s.rank == self.tp_rank]:
                    w.wait()
                return None
            if len(sources) == 1 and sources[0].rank == 0 and (sources[0].col is None or self.tp == 1):
                return p[sources[0].lo:sources[0].hi]          # already in HF layout: a view
            out, works, block = dest.rows(hf, shape, p), [], None
            for s in sources:
                at = out[s.out_lo:s.out_hi]
                if s.col is not None:                  # a column block: one rank's at a time
                    c = p.shape[1]
                    at = at[:, s.col * c:(s.col + 1) * c]
                if s.rank == 0:
                    at.copy_(p[s.lo:s.hi])             # cast on copy, where the wire's differs
                elif s.col is None:                    # whole rows: received in place
                    works.append(torch.distributed.irecv(at, group=group, group_src=s.rank))
                else:                                  # strided there: via a contiguous block
                    if block is None:
                        n = (s.hi - s.lo) * c
                        block = dest.scratch(n * dt.itemsize, p).view(dt).view(s.hi - s.lo, c)
                    torch.distributed.irecv(block, group=group, group_src=s.rank).wait()
                    at.copy_(block)
            for w in works:
                w.wait()
        return out

    # -- state, checkpoints: also while offloaded (swap.py), on the device for the call --
    def state(self) -> dict[str, torch.Tensor]:
        if not self.offloaded:
            return HFState.state(self)
        with self.onloaded():                  # clones: with one rank they may alias the shards
            return {k: v.clone() for k, v in HFState.state(self).items()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        with self.onloaded():
            HFState.load_state(self, state)

    def save_checkpoint(self, folder, keep: int = 3):
        with self.onloaded():
            return DistCheckpoint.save_checkpoint(self, folder, keep)

    def load_checkpoint(self, folder, report=print):
        with self.onloaded():
            return DistCheckpoint.load_checkpoint(self, folder, report)

    # -- training ------------------------------------------------------------------------
    def share(self, mb: MicroBatch) -> MicroBatch:
        """Rows dp_rank::dp of the whole micro-batch: every TP and PP rank of one
        data-parallel replica trains the same rows (each rank holds the whole micro-batch,
        ranks/workers.py: group_command, so nothing is exchanged)."""
        return mb.shard(self.dp_rank, self.dp)

    def _chunks(self, mb: MicroBatch) -> tuple[list[MicroBatch], int]:
        """The share cut into k equal micro-batches for the pipeline schedule (every stage
        sends the same activation shape); the last one padded with empty responses, which
        add nothing to the loss. Returns (chunks, padding rows)."""
        k = max(1, min(self.microbatches, len(mb)))
        c = -(-len(mb) // k)
        k = -(-len(mb) // c)
        pad = c * k - len(mb)
        if pad:
            tail = mb.shard(0, len(mb))               # one row, as a template
            filler = MicroBatch(*(None if t is None else t.expand(pad, *t.shape[1:]).clone()
                                  for t in (getattr(tail, f) for f in MicroBatch.__dataclass_fields__)))
            filler.response_lens.zero_()
            mb = MicroBatch(*(None if a is None else torch.cat([a, b]) for a, b in
                              ((getattr(mb, f), getattr(filler, f)) for f in MicroBatch.__dataclass_fields__)))
        return [MicroBatch(*(None if t is None else t[i * c:(i + 1) * c]
                             for t in (getattr(mb, f) for f in MicroBatch.__dataclass_fields__)))
                for i in range(k)], pad

    def forward_backward(self, mb: MicroBatch, scale: float, last: bool = True) -> dict[str, float]:
        """`last`: no further micro-batch of this step follows (with overlap_grad_reduce the
        gradient reduce starts during this call's backward; earlier calls accumulate).
        `mb`: this rank's `share`."""
        if len(mb) == 0:
            return dict.fromkeys(self._stat_keys, 0.0)
        chunks, pad = self._chunks(mb)
        keep = self.cfg.ppo_epochs > 1 and mb.old_logprobs is None
        return self._schedule(chunks, pad, scale, last, keep)

    def replay_pass(self) -> dict[str, float]:
        """Pass 2.. of trainer.ppo_epochs over the batch's kept chunks (this replica's share
        as pass 1 cut it, the last stage's with pass 1's log-probs as old_logprobs)."""
        acc: dict[str, float] = {}
        for i, (chunks, pad, scale) in enumerate(self.kept):
            for k, v in self._schedule(chunks, pad, scale, i == len(self.kept) - 1, False).items():
                acc[k] = acc.get(k, 0.0) + v
        return acc

    def _schedule(self, chunks: list[MicroBatch], pad: int, scale: float, last: bool,
                  keep: bool) -> dict[str, float]:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        stats = dict.fromkeys(self._stat_keys, 0.0)
        out: dict[str, float] = {}
        kept = list(chunks) if keep else None        # the loss fills in each chunk's log-probs
        B, T = chunks[0].input_ids.shape
        # overlap_grad_reduce: the schedule keeps all but its last micro-batch out of the
        # reduce, and the last runtime micro-batch of the step is the one that launches it
        overlap = self.cfg.overlap_grad_reduce
        self.tconfig.no_sync_func = self.model.no_sync if overlap and last else None
        self.tconfig.grad_sync_func = self.model.start_grad_sync if overlap and last else None
        sync = self.model.no_sync() if overlap and not last else contextlib.nullcontext()
        with scope(), sync:
            get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, scale=scale, out=out, k=len(chunks), kept=kept),
                data_iterator=iter(enumerate(chunks)), model=[self.model], num_microbatches=len(chunks),
                seq_length=T, micro_batch_size=B, forward_only=False)
        if keep:
            self.kept.append((kept, pad, scale))
        if self.tp_rank == 0 and self.pp_rank == self.pp - 1:
            stats.update(out)                          # one report per data-parallel replica
            stats["samples"] -= pad
        return stats

    def _logits(self, model, mb: MicroBatch):
        B, T = mb.input_ids.shape
        dev = device()
        ids = mb.input_ids.to(dev)
        pos = torch.arange(T, device=dev).expand(B, T)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=dev), 1)[None, None]
        return model(ids, pos, causal.expand(B, 1, T, T))

    def _token_logprobs(self, logits: torch.Tensor, mb: MicroBatch):
        """Token log-probs and entropy from this TP rank's vocabulary shard, on the device:
        three [B, T] all-reduces over the TP group, never the [B, T, V] logits."""
        import megatron.core.parallel_state as ps
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        def reduce_max(t):
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX,
                                         group=ps.get_tensor_model_parallel_group())
            return t
        return vocab_parallel_logprobs(
            logits, mb.to(logits.device), self.temperature, vocab_start=self.tp_rank * logits.shape[-1],
            vocab_size=self.args.vocab_size, reduce_sum=reduce_from_tensor_model_parallel_region,
            reduce_max=reduce_max)

    def _forward_step(self, data_iterator, model, scale: float, out: dict, k: int, kept: list | None):
        i, mb = next(data_iterator)
        t0 = time.time()
        output = self._logits(model, mb)
        ref_logits = None
        if self.ref is not None:                       # PP = 1 (checked at construction)
            with torch.no_grad():
                ref_logits = self._logits(self.ref, mb)
        self._mark("forward", i, t0)

        def loss_func(logits):
            mbd = mb.to(logits.device)
            logp, ent = self._token_logprobs(logits, mbd)
            ref_logp = None
            if ref_logits is not None:
                with torch.no_grad():
                    ref_logp = self._token_logprobs(ref_logits, mbd)[0]
            loss, stats = grpo_loss(logp, ent, mbd, clip_eps=self.cfg.clip_eps,
                                    entropy_coef=self.cfg.entropy_coef, tis_cap=self.cfg.tis_cap,
                                    kl_coef=self.cfg.kl_coef, ref_logp=ref_logp)
            for key, v in stat_values(stats).items():
                out[key] = out.get(key, 0.0) + v
            if kept is not None:                       # last stage only: the loss needs them
                kept[i] = replace(mb, old_logprobs=logp.detach())
            # megatron's DDP averages gradients over data-parallel ranks and the schedule
            # divides by the k micro-batches; our 1/N scale (N = global batch) wants sums
            return loss * (scale * self.dp * k), {}
        return output, loss_func

    def _mark(self, what: str, i: int, t0: float) -> None:
        if self.timeline is not None:
            self.timeline.append((what, i, t0, time.time()))

    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits [B, T, V] on the host (collective; the same ids on every
        rank; for tests and debugging: training never gathers the vocabulary). Returned on
        the last pipeline stage, None elsewhere."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
        B, T = input_ids.shape
        mb = MicroBatch(input_ids, torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long),
                        torch.zeros(B, T), torch.zeros(B), torch.zeros(B, dtype=torch.bool), None)
        return self._forward_only(mb, lambda logits: gather_from_tensor_model_parallel_region(
            logits)[..., :self.args.vocab_size].float().cpu())

    def forward_logprobs(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token log-probs, entropy) [B, T] of `mb` as training computes them (vocab-parallel),
        on the host, on the last pipeline stage (None elsewhere). Collective."""
        return self._forward_only(mb, lambda logits: tuple(
            t.float().cpu() for t in self._token_logprobs(logits, mb)))

    def _forward_only(self, mb: MicroBatch, keep):
        from megatron.core.pipeline_parallel import get_forward_backward_func
        B, T = mb.input_ids.shape
        got: list = []

        def step(data_iterator, model):
            next(data_iterator)

            def loss(logits):
                got.append(keep(logits.detach()))
                return logits.sum() * 0, {}
            return self._logits(model, mb), loss
        with scope(), torch.no_grad():
            get_forward_backward_func()(forward_step_func=step, data_iterator=iter([mb]), model=[self.model],
                                        num_microbatches=1, seq_length=T, micro_batch_size=B, forward_only=True)
        return got[0] if got else None

    def optimizer_step(self, bump: bool = True) -> dict[str, float]:
        from megatron.core.distributed import finalize_model_grads
        with scope():
            finalize_model_grads([self.model])
            ok, grad_norm, _ = self.opt.step()
            self.model.zero_grad_buffer()
            self.opt.zero_grad()
            if self.cfg.overlap_param_gather:       # the weights are read right away for the sync
                self.model.start_param_sync(force_sync=True)
        if not ok:
            raise RuntimeError("megatron optimizer step was skipped (non-finite gradients)")
        if bump:                                    # a replayed pass's weights are never synced
            self.version += 1                       # (weights leave only at a sync: sync_stream)
        return {"grad_norm": float(grad_norm or 0.0)}


def _zero_stats() -> dict[str, float]:
    """grpo_loss's stat keys (computed, so they follow grpo.py), all zero."""
    z = torch.zeros(1, 2)
    mb = MicroBatch(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, dtype=torch.long),
                    torch.ones(1, dtype=torch.long), z, torch.zeros(1), torch.zeros(1, dtype=torch.bool), None)
    _, stats = grpo_loss(z, z, mb, clip_eps=0.2, entropy_coef=0.0, tis_cap=1.0)
    return dict.fromkeys(stats, 0.0)
