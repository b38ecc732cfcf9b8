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
parked state (`adopt`). Gradient storages ("grad.<i>") are left out: zero between steps
(`_check_grads_zero`), zeroed by `onload`. Between groups of another TP/PP/DP (`reshard_key`),
`reshard_layout` describes this rank's parameters, main params and moments in megatron-core's
global coordinates for runtime/reshard.py's plan. Adam state exists from the first step on; a trainer that has not
stepped yet gets it at zero first (`_zero_optimizer_states`: the same first step as
megatron's lazy init), so both sides hold the same set.
"""
from __future__ import annotations

import contextlib

import torch

from flexmarl_hpc.runtime.reshard import Block
from flexmarl_hpc.runtime.state_swap import HostBuffers, finish_copies, release
from flexmarl_hpc.trainer.megatron.dist import scope
from flexmarl_hpc.trainer.megatron.hf_state import torch_adam


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

    def _grad_ptrs(self) -> set[int]:
        """data_ptr of each storage that holds gradients (DDP grad buffers, main grads)."""
        grads = [buf.grad_data for buf in [*self.model.buffers, *getattr(self.model, "expert_parallel_buffers", [])]]
        grads += [main.grad for o in self._dist_optimizers() for g in o.optimizer.param_groups for main in g["params"]]
        return {t.untyped_storage().data_ptr() for t in grads if torch.is_tensor(t) and t.untyped_storage().nbytes()}

    def _storages(self) -> list[tuple[str, torch.UntypedStorage, int]]:
        """(host buffer name, storage, bytes) of every distinct non-empty storage of the
        state, in `_state_tensors` order (the same on two trainers of one layout)."""
        storages: dict[int, torch.UntypedStorage] = {}
        for t in self._state_tensors():
            s = t.untyped_storage()
            if s.nbytes() and s.data_ptr() not in storages:
                storages[s.data_ptr()] = s
        grads = self._grad_ptrs()          # named apart: a move does not send them (zero, `_sent`)
        return [(f"{'grad' if p in grads else 'storage'}.{i}", s, s.nbytes())
                for i, (p, s) in enumerate(storages.items())]

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
            if name in host.buffers:
                _bytes_of(s).copy_(host.buffers[name], non_blocking=True)
            else:                                     # a moved-in gradient: zero, never sent
                _bytes_of(s).zero_()
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

    def _check_grads_zero(self, agent: str = "") -> None:
        """A move sends no gradients: they are zero between optimizer steps (`optimizer_step`
        zeroes the grad buffers), which is when a state moves. Checked, not assumed."""
        if self._host is None:
            dirty = [n for n, s, _ in self._storages() if n.startswith("grad.") and _bytes_of(s).any()]
        else:
            # a shelved arrival has no host copy of its grads (never sent; `onload` zeroes them)
            dirty = [n for n, _, _ in self._parked if n.startswith("grad.") and n in self._host.buffers
                     and self._host.buffers[n].any()]
        if dirty:
            raise ValueError(f"state move{f' of agent {agent!r}' if agent else ''}: gradients are not zero "
                             f"({dirty[0]}); a state moves only between optimizer steps")

    def shards_out(self, host: HostBuffers) -> tuple[HostBuffers, list[tuple[str, int]], torch.Tensor]:
        """Offload into `host` (a resident trainer; a parked one keeps its own buffers), Adam
        state included; returns (the host buffers, their (name, bytes) to send in order, the
        RNG state at the offload). Gradient storages are not sent (zero, checked)."""
        if not self._has_adam_state():
            with self.onloaded(), scope():
                self._zero_optimizer_states()
        self._check_grads_zero()
        self.offload(host)
        return self._host, [(n, nb) for n, _, nb in self._parked if not n.startswith("grad.")], self._parked_rng

    def move_sizes(self) -> list[tuple[str, int]]:
        """What `shards_out` will send, without offloading (a move's header): Adam state made
        first (at zero) where it has not stepped, as `shards_out` does."""
        if not self._has_adam_state():
            with self.onloaded(), scope():
                self._zero_optimizer_states()
        if self._host is not None:
            return [(n, nb) for n, _, nb in self._parked if not n.startswith("grad.")]
        return self.shard_sizes()

    def move_rng(self) -> torch.Tensor:
        """The RNG state that moves with the agent (at its offload, while parked)."""
        return self._parked_rng if self._host is not None else torch.get_rng_state()

    def shard_sizes(self) -> list[tuple[str, int]]:
        """(name, bytes) of the storages `adopt` fills, in order, on a resident trainer (a
        fresh build), whose Adam state is made first, at zero; gradients apart (not sent)."""
        if not self._has_adam_state():
            with scope():
                self._zero_optimizer_states()
        return [(n, nb) for n, _, nb in self._storages() if not n.startswith("grad.")]

    def adopt(self, host: HostBuffers, rng: torch.Tensor, version: int) -> None:
        """Take a counterpart's storage bytes (`host`, names as `shard_sizes`) as this
        resident trainer's parked state: its own storages are freed (nothing copied),
        `onload` brings the bytes in (and zeroes the gradient storages, which have none)."""
        parked = self._storages()
        for _, s, _ in parked:
            s.resize_(0)
        for dev in {s.device for _, s, _ in parked}:
            release(dev)
        self._host, self._parked, self._parked_rng = host, parked, rng
        self.version = version

    # -- resharding between groups of other layouts (runtime/reshard.py) ------------------------
    def reshard_key(self) -> tuple:
        """Equal on two groups whose states reshard into each other at any TP/PP/DP: the
        model, precision, layer spec (TE names its norms apart) and reference model."""
        return ("megatron", repr(self.args), self.bf16, self.te, self.ref is not None)

    def reshard_layout(self) -> tuple[list[Block], list[torch.Tensor]]:
        """This rank's state as `Block`s in megatron-core's own global coordinates (each
        parameter's ShardedTensor from `sharded_state_dict()`, a swiglu fc1 as its two) and
        the flat local tensors they index: the parameter, its fp32 main copy where separate
        (bf16) and both Adam moments over this DP rank's range. Gradients are not in it (zero
        between steps: `_check_grads_zero`); the trainer must be resident."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
        with scope():
            sd = self.gpt.sharded_state_dict()
        tensors = []
        for v in sd.values():
            tensors += [t for t in v.build() if isinstance(t, ShardedTensor)] \
                if isinstance(v, ShardedTensorFactory) else [v] if isinstance(v, ShardedTensor) else []
        params = list(self.gpt.parameters())
        flats: list[torch.Tensor] = []
        slots: dict[int, dict] = {}
        blocks: list[Block] = []
        for st in tensors:
            at = st.data.data_ptr()
            p = next((p for p in params if p.data_ptr() <= at < p.data_ptr() + max(1, p.nbytes)), None)
            if p is None:                  # a buffer, not training state
                continue
            if id(p) not in slots:
                slots[id(p)] = self._flat_slots(p, flats)
            lead, cols = st.prepend_axis_num, p[0].numel() if p.dim() > 1 else 1
            shape, off = tuple(st.global_shape[lead:]), tuple(st.global_offset[lead:])
            if len(shape) > 2:
                raise ValueError(f"resharding: {st.key} has {len(shape)} dims (2 at most)")
            r0 = (at - p.data_ptr()) // (p.element_size() * cols)
            for kind, (slot, flat, size) in slots[id(p)].items():
                blocks.append(Block((kind, st.key, tuple(st.global_offset[:lead])), (shape[0], (shape + (1,))[1]),
                                    (off[0], (off + (0,))[1]), (r0, r0 + st.data.shape[0]), cols, flat, size, slot))
        return blocks, flats

    def _flat_slots(self, p: torch.Tensor, flats: list[torch.Tensor]) -> dict:
        """{kind: (index in `flats`, flat range, bytes per element)} of parameter `p`'s state,
        its flat tensors appended to `flats` (views: writing them writes the state)."""
        out = {"param": (len(flats), (0, p.numel()), p.element_size())}
        flats.append(p.detach().view(-1))
        slot = self._opt_slot(p)
        if slot is None:
            return out
        main, st, rng = slot
        kinds = {"exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}
        if main.untyped_storage().data_ptr() != p.untyped_storage().data_ptr():    # fp32: the param itself
            kinds = {"main": main, **kinds}
        for kind, t in kinds.items():
            out[kind] = (len(flats), (rng.start, rng.end), t.element_size())
            flats.append(t.detach().view(-1))
        return out

    def reshard_out(self, agent: str) -> tuple[list[Block], list[torch.Tensor], float]:
        """Source side (resident): Adam state made at zero if it has not stepped, gradients
        checked zero; (blocks, flat tensors, Adam step count)."""
        if not self._has_adam_state():
            with scope():
                self._zero_optimizer_states()
        self._check_grads_zero(agent)
        blocks, flats = self.reshard_layout()
        return blocks, flats, self._adam_step()

    def reshard_in(self) -> tuple[list[Block], list[torch.Tensor]]:
        """Destination side (a fresh resident build): Adam state at zero to receive into."""
        with scope():
            self._zero_optimizer_states()
        return self.reshard_layout()

    def reshard_done(self, step: float, rng: torch.Tensor, version: int) -> None:
        """After the pieces are in: the source's Adam step count, RNG and version."""
        for o in self._dist_optimizers():
            for g in o.optimizer.param_groups:
                if torch_adam():
                    for main in g["params"]:
                        o.optimizer.state[main]["step"] = torch.tensor(step, dtype=torch.float32)
                else:                          # TE/apex FusedAdam count steps per group
                    g["step"] = int(step)
        torch.set_rng_state(rng)
        self.version = version

    def _adam_step(self) -> float:
        return max([self._step_of(main, o.optimizer.state.get(main, {})) for o in self._dist_optimizers()
                    for g in o.optimizer.param_groups for main in g["params"]], default=0.0)
