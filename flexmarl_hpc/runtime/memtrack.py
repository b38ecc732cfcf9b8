"""Count the tensor bytes a block of code allocates: live bytes and their peak.

torch has no CPU allocator statistics (torch.cuda.memory_stats is CUDA's) and tracemalloc
does not see torch's allocations, so `TensorBytes` is a TorchDispatchMode: every operator
output that owns a storage not seen before (a factory, a copy, a collective's result; not
a view; not a meta tensor) is counted by its storage's bytes until that tensor is garbage (a view keeps its
base alive through `_base`, so the base's lifetime is the storage's). It sees what torch
allocates, on any device; buffers made outside torch's
dispatcher (numpy, `torch.from_numpy`) are counted only where the code reports them with
`external` (weight_sync.host_bytes does).

    with TensorBytes() as mem:
        run()
    mem.peak      # most bytes alive at once inside the block, of tensors it allocated
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


_ACTIVE: list["TensorBytes"] = []


def external(t: torch.Tensor) -> torch.Tensor:
    """Count `t` (a buffer torch's dispatcher did not make, e.g. numpy's) in active trackers."""
    for m in _ACTIVE:
        m._track(t)
    return t


class TensorBytes(TorchDispatchMode):
    def __init__(self, min_bytes: int = 0):
        super().__init__()
        self.live: dict[int, int] = {}        # storage data_ptr -> bytes
        self.now = self.peak = 0
        self.largest = 0                      # the largest single allocation
        self.min_bytes = min_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # an in-place op (or out=, or a collective filling its input) returns an input's storage
        inputs = {(t.device.type, t.untyped_storage().data_ptr()) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t._base is None and \
                    (t.device.type, t.untyped_storage().data_ptr()) not in inputs:
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":                 # shapes only: no memory
            return
        st = t.untyped_storage()
        key, nbytes = (t.device.type, st.data_ptr()), st.nbytes()
        if nbytes < self.min_bytes or key in self.live or st.data_ptr() == 0:
            return
        self.live[key] = nbytes
        self.now += nbytes
        self.peak = max(self.peak, self.now)
        self.largest = max(self.largest, nbytes)
        weakref.finalize(t, self._free, key)

    def _free(self, key) -> None:
        self.now -= self.live.pop(key, 0)

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)
