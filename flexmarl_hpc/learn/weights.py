"""Where an agent's version-0 weights come from, read one trainer shard at a time.

A sharded trainer rank asks a `WeightSource` for its (TP rank, PP stage) shard in megatron's
layout (learn/convert.megatron_shard) and never sees the full model:

- a local HF checkpoint (`model.checkpoint`): each tensor's rows/columns of this shard are
  read with safetensors' `safe_open(...).get_slice`, which reads only those bytes;
- a random init seeded by (run.seed, agent): `init_tensors` draws the tensors one at a time,
  bit-equal to `build_model` (so version 0 is the same at every TP/PP and on the torch
  backend), and only this shard's slices of each are kept.

Pure torch + safetensors: runs under FakeTensorMode (no .item(), no numpy on tensors).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from flexmarl_hpc.learn.convert import megatron_shard, shard_reads
from flexmarl_hpc.learn.model import ModelArgs, init_tensors


def checkpoint_reader(folder: str | Path, device=None):
    """A `megatron_shard` reader over the *.safetensors files of an HF folder (slices only)."""
    from safetensors import safe_open
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {k: h for h in handles for k in h.keys()}

    def read(name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        if name not in where:
            raise KeyError(f"{folder}: tensor {name!r} missing from the checkpoint")
        sl = where[name].get_slice(name)
        if _under_fake_mode():
            return _slice_like(sl, dim, start, stop)
        if dim is None:
            t = sl[:]
        elif dim == 0:
            t = sl[start:stop]
        else:
            t = sl[:, start:stop]
        return t if device is None else t.to(device)
    return read


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
                       "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _under_fake_mode() -> bool:
    """Inside FakeTensorMode (`simulate memory` runs the trainer build there): a tensor made
    from a file's bytes cannot exist, and none is needed, only its shape and dtype."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def _slice_like(sl, dim: int | None, start: int, stop: int) -> torch.Tensor:
    """An empty (fake) tensor of the slice's shape and dtype, read from the file's header only."""
    shape = list(sl.get_shape())
    if dim is not None:
        shape[dim] = stop - start
    dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype())
    if dtype is None:
        raise ValueError(f"safetensors dtype {sl.get_dtype()!r}: expected one of {sorted(_SAFETENSORS_DTYPES)}")
    return torch.empty(shape, dtype=dtype)


def init_reader(args: ModelArgs, seed: int, std: float, reads: dict[str, list[tuple]], device=None):
    """A reader over a random init that keeps, of each tensor as it is drawn, only the slices
    in `reads` (convert.shard_reads): one full tensor exists at a time."""
    kept: dict[tuple, torch.Tensor] = {}
    for name, t in init_tensors(args, seed, std):
        for dim, start, stop in reads.get(name, ()):
            part = t if dim is None else t.narrow(dim, start, stop - start)
            kept[name, dim, start, stop] = part.to(device=device or "cpu", copy=True)
        del t

    def read(name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        return kept[name, dim, start, stop]          # called exactly as recorded
    return read


@dataclass(frozen=True)
class WeightSource:
    """Version 0 of an agent: `checkpoint` (an HF folder) if set, else random init."""

    seed: int = 0
    std: float = 0.02
    checkpoint: str = ""

    def shard(self, args: ModelArgs, tp_rank: int = 0, tp: int = 1, pp_rank: int = 0, pp: int = 1,
              device=None) -> dict[str, torch.Tensor]:
        """This (TP, PP) rank's megatron shard, without the full model."""
        if self.checkpoint:
            read = checkpoint_reader(self.checkpoint, device)
        else:
            read = init_reader(args, self.seed, self.std, shard_reads(args, tp_rank, tp, pp_rank, pp), device)
        return megatron_shard(read, args, tp_rank, tp, pp_rank, pp)
