"""Peak memory of real code run on fake tensors: device bytes and host bytes, nothing allocated.

`track()` enters torch's FakeTensorMode (every tensor is metadata only) and a dispatch mode
that sees every aten op's outputs: a new storage adds its bytes to the device or the host
count and a weakref finalizer takes them off when the storage dies, so `peak` is the high
water mark the same code would reach for real (views share a storage and count once).

Device or host: this CPU-only torch has no CUDA device to put a fake tensor on (a fake
"cuda" tensor cannot be copied to or from the CPU here), so the code runs on its CPU path
(megatron through trainer/megatron/compat.py) and the tag follows where a GPU run puts it:
- a tensor made from others is on the device if any input is (a shard's `.float()` copy);
- a factory op (no tensor input) is on the device inside megatron's device scope
  (`compat.cpu_mode()`, what `dist.scope()` enters around every megatron call) and on the
  host outside it (our `initial_model`, a state-dict clone, a pickled micro-batch);
- `.cpu()` / `.to("cpu")` / `.numpy()` of a device tensor is a new host copy (a no-op on
  the CPU path, so the function mode makes the copy);
- `.to(dist.device())` (the trainer's "cuda", which is "cpu" here) is a copy to the device
  unless its source is there already: `track()` makes `device()` return `ON_DEVICE`, a cpu
  device object told apart by identity (a sharded build's slices, learn/weights.init_reader);
- a tensor on the meta device is not counted (it has no memory on a real run).
Data-dependent scalars (`.item()`, `float(t)`) read 1 and booleans False: a unit grad norm
(no clipping), Adam's step count 1, no inf found; control flow takes the normal path.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_STATE = threading.local()
ON_DEVICE = torch.device("cpu")
"""What the trainer's `dist.device()` returns under `track()`: a `.to()` there is a device copy."""


def _in_device_scope() -> bool:
    return getattr(_STATE, "device", 0) > 0


@contextlib.contextmanager
def device_scope() -> Iterator[None]:
    """Factory ops in here make device tensors (see module doc)."""
    _STATE.device = getattr(_STATE, "device", 0) + 1
    try:
        yield
    finally:
        _STATE.device -= 1


@dataclass
class Counts:
    """Live and peak bytes by "device" / "host", and "all" (their sum: RAM on a CPU run)."""
    live: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "all": 0})
    peak: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "all": 0})

    def reset_peak(self) -> None:
        self.peak = dict(self.live)


class _Tracker(TorchDispatchMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts
        self.tag: dict[int, str] = {}        # id(storage) -> "device" / "host", while alive
        self.force: str | None = None        # set by _HostCopies for the copy it makes

    def _tag_of(self, t: torch.Tensor) -> str | None:
        return self.tag.get(id(t.untyped_storage()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return False if args[0].dtype == torch.bool else 1
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        where = self.force or ("device" if any(self._tag_of(a) == "device" for a in inputs) or
                               (not inputs and _in_device_scope()) else "host")
        for t in torch.utils._pytree.tree_leaves(out):
            # a meta tensor holds no memory on a real run either (init_tensors and _hf_shapes
            # build the whole model on meta for its names and shapes)
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage(), where)
        return out

    def _add(self, st, where: str) -> None:
        key = id(st)
        if key in self.tag:
            return
        self.tag[key] = where
        n = st.nbytes()
        c = self.counts
        for k in (where, "all"):
            c.live[k] += n
            c.peak[k] = max(c.peak[k], c.live[k])
        weakref.finalize(st, self._free, key, where, n)

    def _free(self, key: int, where: str, n: int) -> None:
        self.counts.live[where] -= n
        self.counts.live["all"] -= n
        self.tag.pop(key, None)


def _target(func, args, kwargs):
    """Where a `.cpu()` / `.numpy()` / `.to(...)` moves its tensor: "host", "device"
    (`ON_DEVICE`), or None (no move, or not such a call)."""
    if func in (torch.Tensor.cpu, torch.Tensor.numpy):
        return "host"
    if func is torch.Tensor.to:
        dev = kwargs.get("device", args[1] if len(args) > 1 else None)
        if dev is ON_DEVICE:
            return "device"
        return "host" if isinstance(dev, (str, torch.device)) and torch.device(dev).type == "cpu" else None
    return None


class _HostCopies(TorchFunctionMode):
    """`.cpu()` / `.to("cpu")` of a device tensor: a host copy, as on a GPU; and
    `torch.tensor(list of fake tensors)` (megatron's grad norm), which reads values in C++."""

    def __init__(self, tracker: _Tracker):
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.tensor and args and isinstance(args[0], (list, tuple)):
            leaves = torch.utils._pytree.tree_leaves(args[0])
            if leaves and all(isinstance(t, torch.Tensor) for t in leaves):
                # torch.tensor([fake, ...]) reads the values in C++: stack them instead
                return torch.stack([t.reshape(()) for t in leaves]).to(kwargs.get("dtype") or leaves[0].dtype)
        to = _target(func, args, kwargs) if args and isinstance(args[0], torch.Tensor) else None
        src_tag = self.tracker._tag_of(args[0]) if to else None
        # a move to where the tensor is already is a no-op (unless asked to copy), as on a GPU
        if to == "device" and (src_tag != "device" or kwargs.get("copy")):
            self.tracker.force = "device"
            try:
                out = func(*args, **kwargs)          # also moves a meta micro-batch to cpu
                return out.clone() if out.untyped_storage() is args[0].untyped_storage() else out
            finally:
                self.tracker.force = None
        if to == "host" and src_tag == "device":
            self.tracker.force = "host"
            try:
                src = args[0]
                if func is torch.Tensor.to:
                    dtype = kwargs.get("dtype", next((a for a in args[2:] if isinstance(a, torch.dtype)), src.dtype))
                    return src.to(dtype=dtype, copy=True)
                return src.clone()
            finally:
                self.tracker.force = None
        return func(*args, **kwargs)


@contextlib.contextmanager
def track() -> Iterator[Counts]:
    """Run the body on fake tensors; yields the live and peak device / host byte counts.
    megatron's device scope (compat.cpu_mode) is a device scope here."""
    from flexmarl_hpc.trainer.megatron import compat
    from flexmarl_hpc.trainer.megatron import dist, trainer
    counts = Counts()
    tracker = _Tracker(counts)
    real_mode, real_device = compat.cpu_mode, dist.device

    @contextlib.contextmanager
    def cpu_mode_on_device():
        with device_scope(), real_mode():
            yield
    compat.cpu_mode = cpu_mode_on_device
    dist.device = trainer.device = lambda: ON_DEVICE
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), tracker, _HostCopies(tracker):
            yield counts
    finally:
        compat.cpu_mode = real_mode
        dist.device = trainer.device = real_device
