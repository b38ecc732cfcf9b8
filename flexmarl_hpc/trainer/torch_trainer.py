"""Built-in trainer backend: plain torch, data parallel over the group communicator."""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from .. import comm as C
from ..config import TrainerConfig
from ..grpo import MicroBatch, grpo_loss, stat_values, token_logprobs
from ..model import CausalLM, hf_state_dict
from ..weight_sync import _header


class TorchTrainer:
    def __init__(self, model: CausalLM, cfg: TrainerConfig, group: MPI.Comm, temperature: float):
        self.model = model.train()
        self.packed = flatten_parameters(model)
        self.cfg = cfg
        self.group = group
        self.temperature = temperature
        self.version = 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas,
                                     weight_decay=cfg.weight_decay)
        self.ref = None
        if cfg.kl_coef > 0:
            self.ref = CausalLM(model.args)
            self.ref.load_state_dict(model.state_dict())
            self.ref.requires_grad_(False).eval()

    def forward_backward(self, mb: MicroBatch, scale: float, last: bool = True) -> dict[str, float]:
        if len(mb) == 0:
            return {}
        mask = torch.ones_like(mb.input_ids, dtype=torch.bool)
        logits = self.model(mb.input_ids, mask)
        logp, ent = token_logprobs(logits, mb, self.temperature)
        ref_logp = None
        if self.ref is not None:
            with torch.no_grad():
                ref_logp, _ = token_logprobs(self.ref(mb.input_ids, mask), mb, self.temperature)
        loss, stats = grpo_loss(logp, ent, mb, clip_eps=self.cfg.clip_eps,
                                entropy_coef=self.cfg.entropy_coef, tis_cap=self.cfg.tis_cap,
                                kl_coef=self.cfg.kl_coef, ref_logp=ref_logp)
        (loss * scale).backward()
        return stat_values(stats)

    def optimizer_step(self) -> dict[str, float]:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        C.allreduce_sum(self.group, flat.numpy())          # SUM: the 1/N scale is already in
        off = 0
        for p, g in zip(self.params, grads):
            p.grad = flat[off:off + g.numel()].view_as(p).clone()
            off += g.numel()
        norm = torch.linalg.vector_norm(flat).item()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.version += 1
        return {"grad_norm": norm}

    def named_weights(self) -> dict[str, torch.Tensor]:
        return hf_state_dict(self.model)

    def packed_weights(self) -> np.ndarray:
        """The bytes of `named_weights()` in weight-sync layout: the parameters live there,
        so a sync broadcasts them without a packing copy."""
        return self.packed

    def state(self) -> dict[str, torch.Tensor]:
        out = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        osd = self.opt.state_dict()
        for i, st in osd["state"].items():
            for k, v in st.items():
                out[f"optim.{i}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
        out["version"] = torch.tensor(self.version)
        out["rng"] = torch.get_rng_state()
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
        torch.set_rng_state(state["rng"])


def flatten_parameters(model: CausalLM) -> np.ndarray:
    """Re-home every parameter into one buffer laid out as the weight-sync header of
    `hf_state_dict(model)` (same order, 16-byte aligned), like megatron's contiguous
    parameter buffers. Returns the buffer as bytes. Call before building the optimizer."""
    named = hf_state_dict(model)
    header = _header(named, 0)
    flat = torch.zeros(header.total, dtype=torch.uint8)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, off, nb in zip(header.names, header.offsets, header.nbytes):
        p = params[name]
        view = flat[off:off + nb].view(p.dtype).view_as(p)
        view.copy_(p.data)
        p.data = view                # tied parameters share the object, so both follow
    return flat.numpy()
