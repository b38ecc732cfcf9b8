"""megatron dist_checkpointing of model and optimizer (fully reshardable format): a
checkpoint saved with one TP/PP/DP layout loads into another. Both calls are collective
over the trainer group. A mixin of MegatronTrainer; at scale this replaces `state()`."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ... import comm as C
from .dist import scope
from .hf_state import torch_adam

_META = {"distrib_optim_sharding_type": "fully_reshardable"}


class DistCheckpoint:
    def _sharded(self, loading: bool):
        model_sd = self.gpt.sharded_state_dict()
        opt_sd = self.opt.sharded_state_dict(model_sd, is_loading=loading, metadata=_META)
        return {"model": model_sd, "optimizer": opt_sd}

    def save_checkpoint(self, folder: str | Path) -> None:
        """Collective: every group rank writes its shards of model and optimizer."""
        from megatron.core import dist_checkpointing
        _fork_only_writer_queue()
        folder = Path(folder)
        if self.leader:
            folder.mkdir(parents=True, exist_ok=True)
        C.barrier(self.group)
        with scope():
            self._zero_optimizer_states()          # the format wants every state tensor
            dist_checkpointing.save(self._sharded(loading=False), str(folder), content_metadata=_META)
        if self.leader:
            (folder / "flexmarl.json").write_text(json.dumps({"version": self.version}))
        C.barrier(self.group)

    def load_checkpoint(self, folder: str | Path) -> None:
        """Collective; the checkpoint may come from another TP/PP/DP layout. Restores the
        optimizer's fp32 main params too (the reshardable format holds them)."""
        from megatron.core import dist_checkpointing
        folder = Path(folder)
        meta = json.loads((folder / "flexmarl.json").read_text())
        with scope():
            self._zero_optimizer_states()
            for o in self._dist_optimizers():
                _tolerate_torch_adam_step(o)
            loaded = dist_checkpointing.load(self._sharded(loading=True), str(folder))
            self.gpt.load_state_dict(loaded["model"], strict=False)
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
                        if torch_adam():
                            st["step"] = torch.tensor(0.0)
                        st["exp_avg"] = torch.zeros_like(main)
                        st["exp_avg_sq"] = torch.zeros_like(main)


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
