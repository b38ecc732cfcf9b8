"""Distributed set-up: torch.distributed + megatron's parallel_state over one trainer group.

Each trainer group is its own torch.distributed world (gloo on CPU, NCCL on GPU) over
exactly the group's ranks, rendezvoused through the group's MPI communicator (the leader
opens a TCPStore on a free port and broadcasts it), so several agents' groups coexist in
one MPI job and megatron's `parallel_state` only sees its group. Also the small MPI byte
helpers (non-spinning, see comm.py) the other modules use to gather shards.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import socket
import warnings
from datetime import timedelta

import numpy as np
import torch
from mpi4py import MPI

from flexmarl_hpc.runtime import comm

_LAYOUT: tuple[int, int, int] | None = None      # (group size, tp, pp) this process runs
# megatron warns on every rank, at import and at each build, that Apex / Transformer Engine
# are absent and that it falls back to torch (expected on CPU), and torch.distributed calls
# it makes are deprecated; a 4-rank job printed 30 such lines before its first step
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.c10d_logger",
                        message=r".*is deprecated")
CUDA = torch.cuda.is_available()


def scope():
    """Where megatron runs: on CPU inside compat's device mode."""
    if CUDA:
        return contextlib.nullcontext()
    from flexmarl_hpc.trainer.megatron import compat
    return compat.cpu_mode()


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")


# -- MPI helpers ------------------------------------------------------------------------------
def allgather_bytes(group: MPI.Comm, data: bytes) -> list[bytes]:
    n = np.array([len(data)], dtype=np.int64)
    sizes = np.zeros(group.Get_size(), dtype=np.int64)
    comm.wait(group.Iallgather(n, sizes))
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    comm.wait(group.Iallgatherv(np.frombuffer(data, dtype=np.uint8), [out, sizes, offs, MPI.BYTE]))
    return [out[o:o + s].tobytes() for o, s in zip(offs, sizes)]


def gather_bytes(group: MPI.Comm, data: bytes, root: int = 0) -> list[bytes] | None:
    n = np.array([len(data)], dtype=np.int64)
    sizes = np.zeros(group.Get_size(), dtype=np.int64)
    comm.wait(group.Igather(n, sizes, root=root))
    me = group.Get_rank() == root
    out = np.empty(int(sizes.sum()) if me else 0, dtype=np.uint8)
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    comm.wait(group.Igatherv(np.frombuffer(data, dtype=np.uint8),
                          [out, sizes, offs, MPI.BYTE] if me else None, root=root))
    return [out[o:o + s].tobytes() for o, s in zip(offs, sizes)] if me else None


def tensors_to_bytes(d: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save
    return save({k: v.detach().to("cpu").contiguous() for k, v in d.items()}) if d else b""


def tensors_from_bytes(b: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load
    return load(b) if b else {}


# -- process-wide set-up ----------------------------------------------------------------------
def _parallel_state(tp: int, pp: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    with scope():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                                 pipeline_model_parallel_size=pp)
        with torch.random.fork_rng(devices=[]):      # keep the caller's CPU RNG stream
            model_parallel_cuda_manual_seed(1234)


def init_group_distributed(group: MPI.Comm, tp: int, pp: int, relayout: bool = False,
                           timeout_s: float = 1800.0) -> None:
    """torch.distributed and megatron's parallel_state over exactly this group's ranks.
    Once per process (a rank belongs to one trainer group); later trainers of the same
    layout (other agents on this group) reuse it. `relayout=True` rebuilds parallel_state
    for another TP/PP split of the same ranks (trainers of the old layout become invalid;
    tests use it to reshard checkpoints in one job). `timeout_s`
    (trainer.collective_timeout_s): the store's rendezvous and every collective's."""
    global _LAYOUT
    key = (group.Get_size(), tp, pp)
    if _LAYOUT is not None:
        if _LAYOUT == key:
            return
        if not relayout or _LAYOUT[0] != key[0]:
            raise RuntimeError(f"this process already runs megatron as (ranks, tp, pp) = {_LAYOUT}, not {key}")
        from megatron.core import parallel_state
        with scope():
            parallel_state.destroy_model_parallel()
        _parallel_state(tp, pp)
        _LAYOUT = key
        return
    if group.Get_size() % (tp * pp):
        raise ValueError(f"trainer.ranks_per_group={group.Get_size()} is not a multiple of "
                         f"tensor_parallel x pipeline_parallel = {tp * pp}")
    if not CUDA:       # on GPU, devices.bind_rank already chose this rank's device (by role)
        from flexmarl_hpc.trainer.megatron import compat
        compat.apply()
    rank, size = group.Get_rank(), group.Get_size()
    if not timeout_s > 0:
        raise ValueError(f"trainer.collective_timeout_s: expected > 0 seconds, got {timeout_s!r}")
    timeout = timedelta(seconds=timeout_s)
    store = None
    if rank == 0:
        # port 0: the OS picks a free port, no race with other groups' leaders on this node
        store = torch.distributed.TCPStore("0.0.0.0", 0, size, is_master=True, timeout=timeout,
                                           wait_for_workers=False)
        where = (socket.gethostname(), store.port)
    else:
        where = None
    host, port = comm.bcast_obj(group, where, 0)
    if rank != 0:
        addr = "127.0.0.1" if host == socket.gethostname() else host
        store = torch.distributed.TCPStore(addr, port, size, is_master=False, timeout=timeout)
    if CUDA:    # a collective past `timeout` makes NCCL's watchdog tear the rank down (the
        # liveness star then ends the job, exit 75) instead of leaving it hung
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    torch.distributed.init_process_group("nccl" if CUDA else "gloo", store=store, rank=rank,
                                         world_size=size, timeout=timeout)
    atexit.register(_shutdown_distributed, group)
    _parallel_state(tp, pp)
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
    comm.barrier(group)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    _LAYOUT = None
