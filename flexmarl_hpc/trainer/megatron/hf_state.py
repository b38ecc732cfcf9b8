"""HF-named weights and optimizer state <-> this rank's megatron shards.

`state()` / `load_state()` use TorchTrainer's format (model.<hf name>, optim.<i>.{step,
exp_avg,exp_avg_sq} with i the parameter index in HF order, version, rng), independent of
TP/PP/DP: a state moves between groups of other layouts and between the two backends.
A mixin of MegatronTrainer (it uses the trainer's layout attributes and optimizer).
"""
from __future__ import annotations

import numpy as np
import torch

from flexmarl_hpc.runtime import comm
from flexmarl_hpc.learn.convert import hf_to_megatron, megatron_to_hf
from flexmarl_hpc.learn.model import ModelArgs
from flexmarl_hpc.trainer.megatron.dist import gather_bytes, scope, tensors_from_bytes, tensors_to_bytes

# megatron's TE spec fuses the pre-attention / pre-MLP norms into the next linear
_TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def param_order(args: ModelArgs) -> list[str]:
    """HF names in CausalLM.parameters() order: TorchTrainer's optimizer indices."""
    from flexmarl_hpc.learn.model import CausalLM
    with torch.device("meta"):
        return [n for n, _ in CausalLM(args).named_parameters()]


def _rename(sd: dict, pairs) -> dict:
    out = {}
    for k, v in sd.items():
        for a, b in pairs:
            if k.endswith(a):
                k = k[: -len(a)] + b
        out[k] = v
    return out


def torch_adam() -> bool:
    """megatron fell back to torch's AdamW (no TE/apex: CPU)."""
    from megatron.core import optimizer as mo
    return bool(getattr(mo, "USING_PYTORCH_OPTIMIZER", not torch.cuda.is_available()))


class HFState:
    # -- weights ---------------------------------------------------------------------------
    def _shard_of(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full HF tensors -> this rank's (TP, PP) shard, by converter names."""
        return hf_to_megatron(hf, self.args, self.tp_rank, self.tp, self.pp_rank, self.pp)

    def _local_params(self) -> dict[str, torch.nn.Parameter]:
        """This rank's parameters by converter name (TP shard of its PP stage)."""
        named = dict(self.gpt.named_parameters())
        return _rename(named, [(b, a) for a, b in _TE_NAMES.items()]) if self.te else named

    def _load_weights(self, hf: dict[str, torch.Tensor]) -> None:
        """Full HF weights (a state's) into this rank's shard: see `_load_shard`."""
        self._load_shard(self._shard_of(hf))

    def _module_names(self, shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Converter names -> this model's (TE's spec fuses the norms into the linears)."""
        return _rename(shard, _TE_NAMES.items()) if self.te else shard

    def _load_shard(self, shard: dict[str, torch.Tensor]) -> None:
        """This rank's megatron shard (converter names) into the model and, exactly (fp32,
        not the bf16 model copy), into the optimizer's main params: with bf16 the
        DistributedOptimizer steps its own fp32 copies and would otherwise revert the load
        at the next step."""
        with torch.no_grad():
            missing, unexpected = self.gpt.load_state_dict(self._module_names(shard), strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"megatron shard mismatch: missing {missing[:4]}, unexpected {unexpected[:4]}")
        if getattr(self, "opt", None) is None:
            return
        for name, p in self._local_params().items():
            slot = self._opt_slot(p)
            if slot is not None:
                main, _, rng = slot
                main.data.copy_(shard[name].reshape(-1)[rng.start:rng.end].to(main).view_as(main))

    def _gather_hf(self, local: dict[str, torch.Tensor], to_all: bool) -> dict[str, torch.Tensor]:
        """HF tensors (fp32) from every (pp, tp) shard of DP replica 0 (`local`: converter-named
        tensors of this rank): on the leader, or on every rank with `to_all`."""
        local = {k: v.detach().float() for k, v in local.items()}
        if self.group.Get_size() == 1:
            return megatron_to_hf([[local]], self.args)
        # DP replicas hold identical copies: replica 0 sends, the others send a header only
        head = np.array([self.pp_rank, self.tp_rank, self.dp_rank], dtype=np.int64).tobytes()
        blobs = gather_bytes(self.group, head + (tensors_to_bytes(local) if self.dp_rank == 0 else b""), 0)
        hf: dict[str, torch.Tensor] = {}
        if self.leader:
            grid = [[None] * self.tp for _ in range(self.pp)]
            for b in blobs:
                pp, tp, dp = np.frombuffer(b[:24], dtype=np.int64).tolist()
                if dp == 0:
                    grid[pp][tp] = tensors_from_bytes(b[24:])
            hf = megatron_to_hf(grid, self.args)
        if to_all:
            hf = comm.bcast_tensors(self.group, hf if self.leader else None, 0)
        return hf

    def _master_weights(self) -> dict[str, torch.Tensor]:
        """This rank's parameter shards at full precision: the optimizer's fp32 main params
        where they are separate (bf16), assembled over the DP ranks holding a range each."""
        if not self.bf16:
            return {k: p.detach() for k, p in self._local_params().items()}
        return self._assemble(lambda main, st: main.detach())[0][0]

    # -- optimizer state -----------------------------------------------------------------
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

    def _assemble(self, *getters) -> tuple[list[dict[str, torch.Tensor]], float]:
        """For each getter(main, state) -> flat shard: full (TP, PP)-local tensors assembled
        over the DP ranks that each hold a range of them; and the Adam step count."""
        from megatron.core import parallel_state as ps
        outs, step = [{} for _ in getters], 0.0
        for name, p in self._local_params().items():
            slot = self._opt_slot(p)
            for out, get in zip(outs, getters):
                t = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
                if slot is not None and get(*slot[:2]) is not None:
                    t[slot[2].start:slot[2].end] = get(*slot[:2]).reshape(-1)
                out[name] = t.view(p.shape)
            if slot is not None and "exp_avg" in slot[1]:
                step = max(step, self._step_of(*slot[:2]))
        if self.dp > 1:
            dev = next(iter(self._local_params().values())).device
            flat = torch.cat([t.view(-1) for d in outs for t in d.values()])
            steps = torch.tensor([step], device=dev)
            with scope():
                torch.distributed.all_reduce(flat, group=ps.get_data_parallel_group())
                torch.distributed.all_reduce(steps, op=torch.distributed.ReduceOp.MAX,
                                             group=ps.get_data_parallel_group())
            off = 0
            for d in outs:
                for k, t in d.items():
                    d[k] = flat[off:off + t.numel()].view_as(t)
                    off += t.numel()
            step = float(steps)
        return outs, step

    def state(self) -> dict[str, torch.Tensor]:
        """Full HF-layout training state, TorchTrainer's format. Collective over the group
        (every rank gets the full state)."""
        weights = self._master_weights()
        (m1, m2), step = self._assemble(lambda main, st: st.get("exp_avg"),
                                        lambda main, st: st.get("exp_avg_sq"))
        hf, hf1, hf2 = (self._gather_hf(d, to_all=True) for d in (weights, m1, m2))
        order = param_order(self.args)
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
        out["rng"] = tensors_from_bytes(comm.bcast_obj(self.group, tensors_to_bytes({"r": rng}), 0))["r"]
        return out

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of `state` (any layout's, or TorchTrainer's). Every group rank calls it."""
        hf = {k[6:]: v for k, v in state.items() if k.startswith("model.")}
        names = param_order(self.args)
        with scope():
            self._load_weights(hf)
            if any(k.startswith("optim.") for k in state):
                self._load_moments(state, names)
            else:
                for o in self._dist_optimizers():
                    o.optimizer.state.clear()
        self.version = int(state["version"])
        torch.set_rng_state(state["rng"])

    def _load_moments(self, state: dict[str, torch.Tensor], names: list[str]) -> None:
        step = float(state["optim.0.step"])
        s1 = self._shard_of({n: state[f"optim.{i}.exp_avg"] for i, n in enumerate(names)})
        s2 = self._shard_of({n: state[f"optim.{i}.exp_avg_sq"] for i, n in enumerate(names)})
        for name, p in self._local_params().items():
            slot = self._opt_slot(p)
            if slot is None:
                continue
            main, st, rng = slot
            st["exp_avg"] = s1[name].reshape(-1)[rng.start:rng.end].to(main).view_as(main).clone()
            st["exp_avg_sq"] = s2[name].reshape(-1)[rng.start:rng.end].to(main).view_as(main).clone()
            if torch_adam():
                st["step"] = torch.tensor(step, dtype=torch.float32)
        if not torch_adam():           # TE/apex FusedAdam count steps per group
            for o in self._dist_optimizers():
                for g in o.optimizer.param_groups:
                    g["step"] = int(step)
