"""Built-in trainer backend: plain torch, data parallel over the group communicator.

CPU-only: gradients are reduced through numpy buffers over MPI and the parameters live in
one host byte buffer (megatron-like contiguous storage; the swap moves it whole). GPU runs use trainer.backend
=megatron. Its swap interface (`offload`/`onload`, flexmarl_hpc.runtime.state_swap.Swappable) is
written for any device: every tensor of the state goes through `_rehome`.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from mpi4py import MPI

from flexmarl_hpc.runtime import comm
from flexmarl_hpc.config.schema import TrainerConfig
from flexmarl_hpc.learn.grpo import MicroBatch, first_scored, grpo_loss, stat_values, token_logprobs
from flexmarl_hpc.learn.model import CausalLM, hf_state_dict
from flexmarl_hpc.runtime.state_swap import HostBuffers, finish_copies, release, to_device
from flexmarl_hpc.runtime.weight_sync import dict_bucket, host_bytes, layout_of
from flexmarl_hpc.store import checkpoint
from flexmarl_hpc.trainer.base import replay


class TorchTrainer:
    def __init__(self, model: CausalLM, cfg: TrainerConfig, group: MPI.Comm, temperature: float):
        self.model = model.train()
        self.packed = flatten_parameters(model)
        self.flat = torch.from_numpy(self.packed)        # owns every parameter's storage
        self.home: torch.device | None = None            # set while offloaded: where to come back
        self.parked_rng: torch.Tensor | None = None
        self.cfg = cfg
        self.group = group
        self.temperature = temperature
        self.version = 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas,
                                     weight_decay=cfg.weight_decay)
        self.kept: list[tuple[MicroBatch, float]] = []   # this batch, for ppo_epochs > 1
        self.ref = None
        if cfg.kl_coef > 0:
            self.ref = CausalLM(model.args)
            self.ref.load_state_dict(model.state_dict())
            self.ref.requires_grad_(False).eval()

    def share(self, mb: MicroBatch) -> MicroBatch:
        """Rows rank::size: every rank of the group is a data-parallel replica."""
        return mb.shard(self.group.Get_rank(), self.group.Get_size())

    def forward_backward(self, mb: MicroBatch, scale: float, last: bool = True) -> dict[str, float]:
        if len(mb) == 0:
            return {}
        mask = torch.ones_like(mb.input_ids, dtype=torch.bool)
        start = first_scored(mb)
        logits = self.model(mb.input_ids, mask, logits_from=start)
        logp, ent = token_logprobs(logits, mb, self.temperature, start)
        ref_logp = None
        if self.ref is not None:
            with torch.no_grad():
                ref_logits = self.ref(mb.input_ids, mask, logits_from=start)
                ref_logp, _ = token_logprobs(ref_logits, mb, self.temperature, start)
        loss, stats = grpo_loss(logp, ent, mb, clip_eps=self.cfg.clip_eps,
                                entropy_coef=self.cfg.entropy_coef, tis_cap=self.cfg.tis_cap,
                                kl_coef=self.cfg.kl_coef, ref_logp=ref_logp)
        (loss * scale).backward()
        if self.cfg.ppo_epochs > 1 and mb.old_logprobs is None:    # pass 1: keep it for the replay
            self.kept.append((replace(mb, old_logprobs=logp.detach()), scale))
        return stat_values(stats)

    def replay_pass(self) -> dict[str, float]:
        """One more pass over the batch's kept micro-batches (trainer/base.py), summed stats."""
        return replay(self, self.kept)

    def optimizer_step(self, bump: bool = True) -> dict[str, float]:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.allreduce_sum(self.group, flat.numpy())          # SUM: the 1/N scale is already in
        off = 0
        for p, g in zip(self.params, grads):
            p.grad = flat[off:off + g.numel()].view_as(p).clone()
            off += g.numel()
        norm = torch.linalg.vector_norm(flat).item()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if bump:                               # a replay pass before the last: same version
            self.version += 1
        return {"grad_norm": norm}

    def named_weights(self) -> dict[str, torch.Tensor]:
        return hf_state_dict(self.model)

    # -- weight sync (runtime/weight_sync.py): one stage, sent by the group leader ---------
    def sync_layouts(self):
        return [layout_of(self.named_weights())]

    def sync_senders(self) -> list[int]:
        return [0]

    def sync_stream(self, pieces=None, dest=None):
        if self.group.Get_rank() == 0:                  # whole tensors (fill_bucket cuts them)
            yield from self.named_weights().items()

    # -- state swap (flexmarl_hpc.runtime.state_swap.Swappable) ------------------------------------
    def offload(self, host: HostBuffers) -> None:
        """Parameters, grads, optimizer moments and the reference model into `host`'s
        reused buffers; the module and optimizer now point there and the device copies go."""
        if self.home is not None:
            return
        dev = self.flat.device
        self._rehome(host.copy_in)
        finish_copies(dev)
        self.home, self.parked_rng = dev, torch.get_rng_state()
        release(dev)

    def onload(self) -> None:
        """Back onto the device it came from: copies only, the same module and optimizer."""
        if self.home is None:
            return
        dev, self.home = self.home, None
        self._rehome(lambda name, t: to_device(t, dev))
        torch.set_rng_state(self.parked_rng)
        self.parked_rng = None

    def _rehome(self, move) -> None:
        """Point every tensor of the training state at `move(name, tensor)`: the flat
        parameter buffer (parameters are views of it), grads, optimizer state, reference."""
        flat = move("params", self.flat)
        for p in self.model.parameters():               # unique: a tied weight is one view
            off = p.storage_offset() * p.element_size()
            p.data = flat[off:off + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
        self.flat = flat
        self.packed = flat.numpy() if flat.device.type == "cpu" else None
        for i, p in enumerate(self.params):
            if p.grad is not None:
                p.grad = move(f"grad.{i}", p.grad)
            st = self.opt.state.get(p, {})
            for k, v in st.items():
                if torch.is_tensor(v):
                    st[k] = move(f"optim.{i}.{k}", v)
        if self.ref is not None:
            for name, p in self.ref.named_parameters():
                p.data = move(f"ref.{name}", p.data)

    def state(self) -> dict[str, torch.Tensor]:
        out = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        osd = self.opt.state_dict()
        for i, st in osd["state"].items():
            for k, v in st.items():
                out[f"optim.{i}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
        out["version"] = torch.tensor(self.version)
        out["rng"] = torch.get_rng_state() if self.home is None else self.parked_rng
        return out

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict({k[6:]: v for k, v in state.items() if k.startswith("model.")})
        osd = self.opt.state_dict()
        osd["state"] = {}
        for k, v in state.items():
            if k.startswith("optim."):
                _, i, name = k.split(".", 2)
                osd["state"].setdefault(int(i), {})[name] = v
        self.opt.load_state_dict(osd)
        self.version = int(state["version"])
        if self.home is None:
            torch.set_rng_state(state["rng"])
        else:                                   # parked: the RNG comes back with onload
            self.parked_rng = state["rng"].clone()

    def save_checkpoint(self, folder: Path, keep: int = 3) -> None:
        """Every rank's replica is whole (data parallel), so the leader writes its `state()`
        as one file; the others only pass the call."""
        if self.group.Get_rank() == 0:
            checkpoint.save_checkpoint(Path(folder), self.version, self.state(), keep)

    def load_checkpoint(self, folder: Path, report: Callable[[str], None] = print) -> int | None:
        """The leader reads the newest valid entry and hands it to every replica (shelved or
        live: load_state keeps an offloaded trainer's tensors in their host buffers)."""
        state = checkpoint.load_latest(Path(folder), report) if self.group.Get_rank() == 0 else None
        state = comm.bcast_tensors(self.group, state, 0)
        if state is None:
            return None
        self.load_state(state)
        return self.version

    def onloaded(self):
        """Nothing to move: a weight sync streams this trainer's tensors from wherever they
        are (host buffers while shelved; the torch backend runs on the CPU)."""
        return contextlib.nullcontext()


def flatten_parameters(model: CausalLM) -> np.ndarray:
    """Re-home every parameter into one buffer laid out as `hf_state_dict(model)` (same
    order, 16-byte aligned), like megatron's contiguous
    parameter buffers. Returns the buffer as bytes. Call before building the optimizer."""
    named = hf_state_dict(model)
    header = dict_bucket(named)
    flat = host_bytes(header.total).zero_()      # on huge pages: the weight broadcast reads it whole
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, off, nb in zip(header.names, header.offsets, header.nbytes):
        p = params[name]
        view = flat[off:off + nb].view(p.dtype).view_as(p)
        view.copy_(p.data)
        p.data = view                # tied parameters share the object, so both follow
    return flat.numpy()
