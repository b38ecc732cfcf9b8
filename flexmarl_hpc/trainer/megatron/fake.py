"""megatron-core over a fake process group, for the memory check (flexmarl_hpc/sim/memory.py).

One process plays one rank of a trainer group at its real size: torch.distributed runs the
"fake" backend (collectives return at once, nothing moves), megatron's parallel_state is
built by the same `dist._parallel_state` a job uses, and the group's MPI communicator is a
`FakeComm` that knows its rank and size. Run under FakeTensorMode (sim/fake_memory.py) nothing
is allocated, so a 32B model's rank builds and steps in seconds on a laptop.

What differs from a job, and why:
- megatron's gloo side groups are made on the fake backend too (gloo cannot run there);
- object collectives (`all_gather_object`, used once by the optimizer's param grouping)
  return this rank's object for every rank: the ranks of one TP/PP position are symmetric;
- `allgather_bytes` answers the trainer's build exchange as a job would: every rank's
  (pp, tp, dp) coordinates (megatron's rank order: TP fastest, then DP, then PP);
- `HFState._gather_hf` (HF weights gathered to the group leader over MPI: fake tensors have
  no bytes to send) makes what the real one makes: each shard's fp32 copy on the device, its
  serialised bytes on the host, and on the leader every shard's bytes and the full HF-named
  fp32 tensors (shapes from `FakeComm.hf_shapes`).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import numpy as np
import torch
import torch.distributed as tdist

from flexmarl_hpc.trainer.megatron import compat, dist
from flexmarl_hpc.trainer.megatron.hf_state import HFState


class FakeComm:
    """The trainer group's communicator as one rank sees it (rank, size)."""

    def __init__(self, rank: int, size: int, answers: list[list[bytes]] | None = None):
        self.rank, self.size = rank, size
        self.answers = list(answers or [])          # the next allgathers' results, in order
        self.hf_shapes: dict[str, tuple[int, ...]] = {}

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size


def _allgather_bytes(group, data: bytes) -> list[bytes]:
    if isinstance(group, FakeComm):
        if group.answers:
            return group.answers.pop(0)
        return [data] * group.size
    return _REAL_ALLGATHER(group, data)


_REAL_ALLGATHER = dist.allgather_bytes


def _gather_hf(self, local: dict, to_all: bool) -> dict:
    if not isinstance(self.group, FakeComm) or self.group.size == 1:   # one rank: no MPI in it
        return _REAL_GATHER_HF(self, local, to_all)
    local = {k: v.detach().float() for k, v in local.items()}
    blob = torch.empty(sum(v.numel() for v in local.values()) * 4 + 24, dtype=torch.uint8)
    if not (self.leader or to_all):
        return {}
    shapes = self.group.hf_shapes
    received = torch.empty(sum(math.prod(s) for s in shapes.values()) * 4, dtype=torch.uint8)
    hf = {k: torch.empty(s, dtype=torch.float32) for k, s in shapes.items()}
    del blob, received
    return hf


_REAL_GATHER_HF = HFState._gather_hf


class _Uncoalesced:
    """Stands in for torch's _coalescing_manager: FakeTensorMode has no kernel for the
    coalesced collectives, so each bucket's collective is issued on its own (what the
    manager would batch; the same tensors, so the same memory)."""

    def __init__(self, *a, **k): ...
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None: ...
    def wait(self) -> None: ...


def _all_gather_object(out: list, obj, group=None) -> None:
    out[:] = [obj] * len(out)


def _swap_tensors(t1, t2):
    """torch.nn.Module._apply swaps a FakeTensor parameter for its converted copy, and refuses
    when a weakref points at it (torch 2.13 leaves one on every fake Parameter): same
    metadata is a no-op, a dtype change re-points `.data`."""
    if (t1.dtype, t1.shape, t1.device) == (t2.dtype, t2.shape, t2.device):
        return
    t1.data = t2.detach()


def _coordinates(size: int, tp: int, pp: int) -> list[bytes]:
    """Every rank's (pp, tp, dp) as the trainer's build exchanges them (megatron's order)."""
    dp = size // (tp * pp)
    return [np.array([r // (tp * dp), r % tp, (r // tp) % dp], dtype=np.int64).tobytes() for r in range(size)]


@contextlib.contextmanager
def fake_group(rank: int, size: int, tp: int, pp: int) -> Iterator[FakeComm]:
    """torch.distributed ("fake") and megatron's parallel_state for rank `rank` of a group of
    `size` ranks at TP x PP; yields the group's FakeComm. Undone on exit."""
    from megatron.core import parallel_state
    from flexmarl_hpc.trainer.megatron import trainer as trainer_mod
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist._LAYOUT is not None or tdist.is_initialized():
        raise RuntimeError("fake_group: this process already runs torch.distributed")
    if size % (tp * pp):
        raise ValueError(f"ranks {size} is not a multiple of tensor_parallel x pipeline_parallel = {tp * pp}")
    compat.apply()
    new_group, ago, swap = tdist.new_group, tdist.all_gather_object, torch.utils.swap_tensors
    tdist.new_group = lambda *a, **k: new_group(*a, **{**k, "backend": None})
    tdist.all_gather_object = _all_gather_object
    torch.utils.swap_tensors = _swap_tensors
    trainer_mod.allgather_bytes = _allgather_bytes
    HFState._gather_hf = _gather_hf
    import megatron.core.distributed.param_and_grad_buffer as pgb
    coalescing, pgb._coalescing_manager = pgb._coalescing_manager, _Uncoalesced
    tdist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    try:
        dist._parallel_state(tp, pp)
        dist._LAYOUT = (size, tp, pp)
        yield FakeComm(rank, size, [_coordinates(size, tp, pp)])
    finally:
        dist._LAYOUT = None
        with dist.scope():
            parallel_state.destroy_model_parallel()
        tdist.destroy_process_group()
        tdist.new_group, tdist.all_gather_object, torch.utils.swap_tensors = new_group, ago, swap
        trainer_mod.allgather_bytes = _REAL_ALLGATHER
        HFState._gather_hf = _REAL_GATHER_HF
        pgb._coalescing_manager = coalescing
