"""Run megatron-core on a CUDA-less torch build (CPU, gloo): the compatibility layer.

megatron-core assumes a GPU in a handful of places that have nothing to do with the maths:
buffers are allocated on `torch.cuda.current_device()`, checkpoint loading and timers call
`torch.cuda.synchronize()`, the gradient sync (>= 0.17) asks for `torch.cuda.current_stream()`,
the tensor-parallel RNG tracker saves and restores CUDA generator states, some tensors are
created with `device="cuda"` or moved with `.cuda()`, and the optimizers accept a parameter
only when `param.type()` says `torch.cuda.FloatTensor`. This module maps each of those to the
CPU and changes nothing else, so the model, the schedules, DDP, the DistributedOptimizer and
dist_checkpointing run their real code paths on CPU ranks over gloo. Checked with
megatron-core 0.16.1 (python 3.11, .venv) and 0.17.1, 0.18.2, 0.19.2 (python 3.12, torch
2.13.0): the same patches serve all four, none is version-gated. 0.19 adds two log notices
per trainer build (GPTModel deprecated in favour of HybridModel; DDP auto-computes the
DistributedOptimizer's param layout), which are left visible.

Two parts:
  * `apply()`: process-wide patches of `torch.cuda` functions (idempotent). Asserts that
    CUDA is absent: on a GPU nothing here may run.
  * `cpu_mode()`: a context manager with a TorchFunctionMode that rewrites `device="cuda"`
    to CPU, makes `Tensor.cuda()` a no-op and makes `Tensor.type()` report `torch.cuda.*`.
    It is scoped (every megatron call of flexmarl_hpc.trainer.megatron runs inside
    it) because a function mode sees every torch call of the process.

    from flexmarl_hpc.trainer.megatron import compat as megatron_compat
    megatron_compat.apply()
    with megatron_compat.cpu_mode():
        ...  # build / run megatron-core

Check: `.venv/bin/python -m pytest tests/mpi/test_megatron.py`; other megatron-core releases in a
side venv: `bash scripts/check_megatron_versions.sh 0.19.2 0.18.2 0.17.1`.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

_APPLIED: list[str] = []
_CPU = torch.device("cpu")


class _NullStream:
    """Stands in for a CUDA stream: CPU work is already ordered."""

    def wait_event(self, *a, **k) -> None: ...
    def wait_stream(self, *a, **k) -> None: ...
    def synchronize(self) -> None: ...
    def record_event(self, *a, **k) -> None: ...
    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None: ...


def _drop_cpu_rng_fork_warning(record: logging.LogRecord) -> bool:
    return record.getMessage() != "CPU RNG state changed within GPU RNG context"


def apply() -> list[str]:
    """Patch `torch.cuda` for megatron-core on CPU; returns what was patched. Idempotent."""
    assert not torch.cuda.is_available(), "megatron compat is for CUDA-less hosts only"
    if _APPLIED:
        return list(_APPLIED)
    cuda = torch.cuda
    # buffers, grad buffers and scratch memory are allocated on current_device()
    cuda.current_device = lambda: _CPU
    cuda.synchronize = lambda *a, **k: None
    # >= 0.17: the grad buffer's sync waits on torch.cuda.current_stream() (0.16.1 never asks)
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.empty_cache = lambda: None
    # the TP RNG tracker forks CUDA generator states; on CPU the CPU generator plays that role
    # (fork() restores the caller's state afterwards, so the global stream is not disturbed)
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.random.get_rng_state = cuda.get_rng_state
    # the CPU generator itself: torch.manual_seed would call cuda.manual_seed_all (recursion)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    import megatron.core.tensor_parallel.random as tp_random
    tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # fork() notes the CPU state after switching the tracked one in, and warns if it moved: on
    # CPU the tracked state IS the CPU generator's, so every draw inside (dropout) moves it by
    # design, and the caller's state is put back on exit. Only that one message is dropped.
    logging.getLogger(tp_random.__name__).addFilter(_drop_cpu_rng_fork_warning)
    _APPLIED.extend(["torch.cuda.current_device -> cpu", "torch.cuda.synchronize/empty_cache -> no-op",
                     "torch.cuda streams -> null stream", "CUDA RNG state -> CPU RNG state"])
    return list(_APPLIED)


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's optimizers accept only 'torch.cuda.{Float,Half,BFloat16}Tensor'
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_mode() -> Iterator[None]:
    """Scope in which megatron-core's device='cuda' tensors land on the CPU (see module doc).
    Re-entrant; a no-op when CUDA is present."""
    if torch.cuda.is_available():
        yield
        return
    apply()
    with _CudaToCpu():
        yield


_GLOBAL_MODE: _CudaToCpu | None = None


def enable() -> list[str]:
    """`apply()` plus the device-rewriting mode entered for the rest of the process (for code
    that calls megatron outside a `cpu_mode()` scope). Idempotent."""
    global _GLOBAL_MODE
    patched = apply()
    if _GLOBAL_MODE is None:
        _GLOBAL_MODE = _CudaToCpu()
        _GLOBAL_MODE.__enter__()
    return patched + ["TorchFunctionMode: device='cuda' -> cpu, Tensor.cuda() no-op, "
                      "Tensor.type() reports torch.cuda.*"]
