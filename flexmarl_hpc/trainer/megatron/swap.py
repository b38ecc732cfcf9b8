"""State swap of a megatron trainer (flexmarl_hpc.runtime.state_swap.Swappable): this rank's own
shards of parameters, grads and optimizer state go to preallocated host memory and back,
the module, DDP wrapper and optimizer objects are kept.

Megatron's tensors alias each other: the parameters and their `main_grad`s are views of the
DDP buffers (`param_data`, `grad_data`), each bucket keeps views of those, with fp32 the
DistributedOptimizer's main params are views of the parameter buffer, and megatron caches
shard lists of them. Re-pointing each tensor would miss some view. So a swap acts on the
*storages* (as megatron's own `_ParamAndGradBuffer.offload_to_cpu` does for its buffers):
every distinct storage of the training state is copied into its host buffer (non-blocking
into pinned memory on GPUs) and then resized to 0 bytes, which frees the device memory
while every view keeps its storage object; swap-in resizes each storage back and copies
the bytes in. Nothing is rebuilt or read from disk, the bytes come back unchanged.

While offloaded, `state()` / `load_state()` / the dist checkpoint calls, `named_weights()`
and a weight sync's stream bring the state onto the device for the call and park it again
(collective, like the calls themselves).

Between groups of the same layout (`shard_key`), the host buffers themselves move
(runtime/state_swap.py, `ShardMovable`): the source offloads and sends its storages' bytes
(`shards_out`), the destination's fresh trainer of the same layout has the same storages in
the same order (`shard_sizes`, checked against the sender's) and takes the bytes as its
parked state (`adopt`). Adam state exists from the first step on; a trainer that has not
stepped yet gets it at zero first (`_zero_optimizer_states`: the same first step as
megatron's lazy init), so both sides hold the same set.
"""
from __future__ import annotations

import contextlib

import torch

from flexmarl_hpc.runtime.state_swap import HostBuffers, finish_copies, release
from flexmarl_hpc.trainer.megatron.dist import scope


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor (a view: same memory)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Swap:
    _host: HostBuffers | None = None
    _parked: list = []                          # (buffer name, storage, nbytes) while offloaded
    _parked_rng: torch.Tensor | None = None

    def _state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of this rank's training state (views included; storages dedupe):
        DDP parameter and grad buffers, parameters outside them, the optimizer's main
        params (fp32 copies with bf16) with their grads and Adam state, the reference model."""
        out: list[torch.Tensor] = []
        for buf in [*self.model.buffers, *getattr(self.model, "expert_parallel_buffers", [])]:
            out += [buf.param_data, buf.grad_data]
        out += list(self.model.parameters())
        for o in self._dist_optimizers():
            for g in o.optimizer.param_groups:
                for main in g["params"]:
                    # by key: load_state and a step insert the Adam keys in different orders
                    st = o.optimizer.state.get(main, {})
                    out += [main, main.grad, *(st[k] for k in sorted(st))]
        if getattr(self, "ref", None) is not None:
            out += list(self.ref.parameters())
        return [t for t in out if torch.is_tensor(t)]

    def _storages(self) -> list[tuple[str, torch.UntypedStorage, int]]:
        """(host buffer name, storage, bytes) of every distinct non-empty storage of the
        state, in `_state_tensors` order (the same on two trainers of one layout)."""
        storages: dict[int, torch.UntypedStorage] = {}
        for t in self._state_tensors():
            s = t.untyped_storage()
            if s.nbytes() and s.data_ptr() not in storages:
                storages[s.data_ptr()] = s
        return [(f"storage.{i}", s, s.nbytes()) for i, s in enumerate(storages.values())]

    def offload(self, host: HostBuffers) -> None:
        if self._host is not None:
            return
        parked = self._storages()
        for name, s, _ in parked:
            host.copy_in(name, _bytes_of(s))
        devices = {s.device for _, s, _ in parked}    # torch's Adam keeps `step` on the host
        for dev in devices:
            finish_copies(dev)
        for _, s, _ in parked:
            s.resize_(0)                              # every view keeps its (now empty) storage
        self._host, self._parked, self._parked_rng = host, parked, torch.get_rng_state()
        for dev in devices:
            release(dev)

    def onload(self) -> None:
        if self._host is None:
            return
        host, parked, self._host, self._parked = self._host, self._parked, None, []
        for name, s, n in parked:
            s.resize_(n)
            _bytes_of(s).copy_(host.buffers[name], non_blocking=True)
        for dev in {s.device for _, s, _ in parked}:
            finish_copies(dev)
        torch.set_rng_state(self._parked_rng)
        self._parked_rng = None

    @property
    def offloaded(self) -> bool:
        return self._host is not None

    @contextlib.contextmanager
    def onloaded(self):
        """The state on the device for the block, parked again after it (if it was), and the
        caller's RNG stream untouched. Collective when the trainer is offloaded."""
        host = self._host
        if host is None:
            yield
            return
        rng = torch.get_rng_state()
        self.onload()
        try:
            yield
        finally:
            self.offload(host)
            torch.set_rng_state(rng)

    # -- shard to shard between groups of one layout (runtime/state_swap.ShardMovable) --------
    def shard_key(self) -> tuple:
        """What a counterpart rank must share for its storages to take this rank's bytes: the
        model, the layout (group size, TP, PP, DP), this rank's place in it, precision, the
        layer spec and whether a reference model exists."""
        return ("megatron", repr(self.args), self.group.Get_size(), self.tp, self.pp, self.dp,
                self.tp_rank, self.pp_rank, self.dp_rank, self.bf16, self.te, self.ref is not None)

    def _has_adam_state(self) -> bool:
        return all("exp_avg" in o.optimizer.state.get(main, {}) for o in self._dist_optimizers()
                   for g in o.optimizer.param_groups for main in g["params"])

    def shards_out(self, host: HostBuffers) -> tuple[HostBuffers, list[tuple[str, int]], torch.Tensor]:
        """Offload into `host` (a resident trainer; a parked one keeps its own buffers), Adam
        state included; returns (the host buffers, their (name, bytes) to send in order, the
        RNG state at the offload)."""
        if not self._has_adam_state():
            with self.onloaded(), scope():
                self._zero_optimizer_states()
        self.offload(host)
        return self._host, [(n, nb) for n, _, nb in self._parked], self._parked_rng

    def shard_sizes(self) -> list[tuple[str, int]]:
        """(name, bytes) of the storages `adopt` fills, in order, on a resident trainer (a
        fresh build), whose Adam state is made first, at zero."""
        if not self._has_adam_state():
            with scope():
                self._zero_optimizer_states()
        return [(n, nb) for n, _, nb in self._storages()]

    def adopt(self, host: HostBuffers, rng: torch.Tensor, version: int) -> None:
        """Take a counterpart's storage bytes (`host`, names as `shard_sizes`) as this
        resident trainer's parked state: its own storages are freed (nothing copied),
        `onload` brings the bytes in."""
        parked = self._storages()
        for _, s, _ in parked:
            s.resize_(0)
        for dev in {s.device for _, s, _ in parked}:
            release(dev)
        self._host, self._parked, self._parked_rng = host, parked, rng
        self.version = version
