"""megatron dist_checkpointing of model and optimizer (fully reshardable format): a
checkpoint saved with one TP/PP/DP layout loads into another. Both calls are collective
over the trainer group. A mixin of MegatronTrainer; the job checkpoints megatron trainers
this way (no full-model gather per rank, as `state()` would need).

Entries go through flexmarl_hpc.store.checkpoint like the torch backend's files: every rank
writes its shards into the staging folder `v<version>.tmp/`, the leader `publish`es it
(fsync, rename to `v<version>/`, sha256 manifest, `latest`, prune), and loading takes
`newest_valid`: a corrupted or half-written newest entry is reported and the older one
loaded. An entry that is a torch-format file (`state()`, written for an agent parked as a
plain state) loads through `load_state`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.checkpoint import CheckpointException

from flexmarl_hpc.runtime import comm
from flexmarl_hpc import faults
from flexmarl_hpc.store.checkpoint import CheckpointError, newest_valid, publish, staging_path, writing
from flexmarl_hpc.trainer.megatron.dist import allgather_bytes, scope
from flexmarl_hpc.trainer.megatron.hf_state import torch_adam

_META = {"distrib_optim_sharding_type": "fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient": True}
"""The format: reshardable across TP/PP/DP. mem_efficient: with DP > 1 the save gathers the
optimizer state to DP rank 0 over gloo (megatron-core 0.16 distrib_optimizer.
sharded_param_state_fully_reshardable) instead of all-gathering it to every rank through the
GPU: 12 B a parameter of the rank's shard on the host of every rank ran the paper config's
trainer nodes to 1.3 TB in `simulate memory` (docs/simulator.md); loading is the same either
way."""


class DistCheckpoint:
    def _sharded(self, loading: bool):
        model_sd = self.gpt.sharded_state_dict()
        opt_sd = self.opt.sharded_state_dict(model_sd, is_loading=loading, metadata=_META)
        return {"model": model_sd, "optimizer": opt_sd}

    def save_checkpoint(self, folder: str | Path, keep: int = 3) -> Path:
        """Collective: every group rank writes its shards of model and optimizer into the
        staging entry, the leader publishes it as checkpoint `version` of `folder` (keeping
        the last `keep`). Returns the entry. A failure on any rank is a CheckpointError on
        every rank; older checkpoints are intact."""
        from megatron.core import dist_checkpointing
        _write_in_process()
        for o in self._dist_optimizers():
            _gather_without_copies(o)
        folder = Path(folder)
        tmp = folder / "none"
        if self.leader:
            tmp = staging_path(folder, self.version, is_dir=True)
            tmp.mkdir()
        tmp = Path(comm.bcast_obj(self.group, str(tmp), 0))
        err = ""
        try:
            with writing(tmp), scope():
                _WriteErrors.seen.clear()
                self._zero_optimizer_states()          # the format wants every state tensor
                try:
                    dist_checkpointing.save(self._sharded(loading=False), str(tmp), content_metadata=_META)
                except CheckpointException as e:     # a BaseException wrapping a writer's error
                    raise _root_cause(e, tmp) from None    # writing() reports a full disk in one line
                if self.leader:
                    (tmp / "flexmarl.json").write_text(json.dumps({"version": self.version}))
                faults.hit("checkpoint_write")        # test-only: no-op unless FLEXMARL_FAULT is set
        except OSError as e:
            err = f"{e.errno or 0}\t{e}"              # the errno travels: a full disk exits 75
        errs = [e.decode() for e in allgather_bytes(self.group, err.encode()) if e]
        entry = folder / "none"
        if self.leader and not errs:
            try:
                entry = publish(folder, self.version, tmp, keep)
            except OSError as e:
                errs = [f"{e.errno or 0}\t{e}"]
        errs = comm.bcast_obj(self.group, errs, 0)
        if errs:
            code, _, message = errs[0].partition("\t")
            raise CheckpointError(message, int(code) or None)
        return entry

    def load_checkpoint(self, folder: str | Path, report: Callable[[str], None] = print) -> int | None:
        """Collective: load the newest valid checkpoint of `folder` (the leader verifies the
        manifests and reports bad entries); returns its version, None if there is none. The
        checkpoint may come from another TP/PP/DP layout; it restores the optimizer's fp32
        main params too (the reshardable format holds them)."""
        found = newest_valid(Path(folder), report) if self.leader else None
        found = comm.bcast_obj(self.group, None if found is None else (found[0], str(found[1])), 0)
        if found is None:
            return None
        entry = Path(found[1])
        if entry.is_file():
            self.load_state(torch.load(entry, weights_only=True))
        else:
            self._load_entry(entry)
        return self.version

    def _load_entry(self, folder: Path) -> None:
        from megatron.core import dist_checkpointing
        meta = json.loads((folder / "flexmarl.json").read_text())
        with scope():
            self._zero_optimizer_states()
            for o in self._dist_optimizers():
                _tolerate_torch_adam_step(o)
            loaded = dist_checkpointing.load(self._sharded(loading=True), str(folder))
            self.gpt.load_state_dict(loaded["model"], strict=False)
            self.opt.load_state_dict(loaded["optimizer"])
        self.version = int(meta["version"])

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


def _root_cause(e: CheckpointException, folder: Path) -> Exception:
    """The error beneath a failed dist_checkpointing save: a writer thread's OSError where
    there is one, else the OSError its checkpoint file raised (`_WriteErrors`: torch's C++
    serializer reports a short write as a RuntimeError, "unexpected pos ...", and drops the
    errno of a full disk). Anything else is the first failure, as a RuntimeError."""
    first = None
    for exc, _trace in e.failures.values():
        while exc is not None:
            if isinstance(exc, OSError):
                return exc
            first = first or RuntimeError(f"dist_checkpointing save: {type(exc).__name__}: {exc}".splitlines()[0])
            exc = exc.__cause__ or exc.__context__
    if _WriteErrors.seen:
        return _WriteErrors.seen[0]
    return first or RuntimeError(f"{folder}: dist_checkpointing save failed")


class _WriteErrors:
    """The checkpoint files of megatron's writer, with the OSError of a failed write kept
    (`seen`, cleared by each save): torch.save writes a tensor through the file's `write`
    from C++ and turns its OSError into "unexpected pos ...", so the errno (ENOSPC) survives
    only here. Deciding "disk full" from free space after the fact would race with another
    rank's cleanup freeing it."""
    seen: list[OSError] = []

    def __init__(self, f):
        self._f = f

    @classmethod
    def open(cls, *args, **kwargs) -> "_WriteErrors":
        return cls(open(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def write(self, data):
        return self._keep(self._f.write, data)

    def flush(self) -> None:
        self._keep(self._f.flush)

    def close(self) -> None:
        self._keep(self._f.close)

    def _keep(self, fn, *args):
        try:
            return fn(*args)
        except OSError as e:
            self.seen.append(e)
            raise


_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


def _gather_without_copies(opt) -> None:
    """The fully reshardable save starts from `get_parameter_state_dp_zero`: every buffer's
    main params and Adam moments gathered over the DP group into "world" tensors. megatron
    builds them through a local shard, a receive list and a concatenation, three more copies
    of the state alive at once: ~8x the model's fp32 bytes on top of the trainer (two
    SmolLM2 trainers saving together ran a 24 GiB CI node out of memory). With one DP rank
    the gather is the identity: this rank's states go into the world tensors directly, and
    the save's peak is the world tensors alone. Larger DP groups keep megatron's gather."""
    if opt.data_parallel_group.size() != 1 or getattr(opt, "_flexmarl_dp1_state", False):
        return

    def get_parameter_state_dp_zero(use_gloo_comm=True, empty_data=False, return_on_all_ranks=False):
        state: dict = {"buckets_coalesced": True}
        for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
            (dtype, bucket_maps), = gbuf_range_maps.items()       # megatron: one dtype per buffer
            buffer = opt.buffers[gbuf_idx]
            world = {k: torch.zeros(buffer.numel_unpadded, dtype=torch.float32) for k in _STATE_KEYS}
            offset = 0
            for bucket, bucket_map in zip(buffer.buckets, bucket_maps):
                for model_param, ranges in ([] if empty_data else bucket_map["param_map"].items()):
                    local = ranges["gbuf_local"]
                    assert local.end <= bucket.numel_unpadded, (local, bucket.numel_unpadded)
                    states = opt._get_main_param_and_optimizer_states(model_param)
                    for k in _STATE_KEYS:
                        world[k][offset + local.start:offset + local.end].copy_(states[k].detach().view(-1))
                offset += bucket.numel_unpadded
            state[gbuf_idx] = {dtype: {**world, "numel_unpadded": buffer.numel_unpadded}}
        return state

    opt.get_parameter_state_dp_zero = get_parameter_state_dp_zero
    opt._flexmarl_dp1_state = True


def _exact_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` on a storage of exactly its own bytes, aliasing them (no copy). torch.save writes a
    tensor's whole storage, so megatron's writer clones every CPU tensor that is a view into
    a larger one (a parameter of the DDP buffer, a slice of a world tensor): the whole
    checkpoint once more in memory before the first byte is written. A save here is
    synchronous, so nothing changes the aliased bytes while they are written. DLPack gives
    the alias a storage sized by its shape and keeps `t` alive; unlike `numpy()` it leaves
    the original storage resizable (a state swap resizes the DDP buffers to 0 bytes)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.untyped_storage().nbytes() == t.nbytes:
        return t
    return torch.from_dlpack(t.detach())


class _ExactStorages:
    """A save planner whose resolved tensors are `_exact_storage`s."""

    def __init__(self, planner):
        self._planner = planner

    def __getattr__(self, name):
        return getattr(self._planner, name)

    def resolve_data(self, item):
        data = self._planner.resolve_data(item)
        return _exact_storage(data) if isinstance(data, torch.Tensor) else data


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


def _write_in_process() -> None:
    """dist_checkpointing's writer is built for async saves: it forks one writer process per
    bucket and collects their results through a multiprocessing Manager (another process,
    started with *spawn*, which re-imports the MPI program and dies in PMI_Init). A sync save
    gains nothing from processes here, and forking an MPI rank is a hazard: the fork copies
    a multithreaded process (a lock held by another thread stays held in the child), doubles
    its resident pages as they are touched, and a child outliving a killed rank keeps the
    rank's stdout open, so mpiexec waits for it forever. The buckets are written by threads
    of the rank instead (file writes release the GIL); results go through thread queues."""
    import queue
    from concurrent.futures import ThreadPoolExecutor
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    except ImportError:
        return
    writer = fa.FileSystemWriterAsync
    if getattr(writer, "_flexmarl_in_process", False):
        return

    def write_buckets(transform_list, use_msc, rank, buckets, results) -> None:
        done, count = queue.Queue(), queue.Queue()
        with ThreadPoolExecutor(max_workers=max(1, len(buckets))) as pool:
            for i, bucket in enumerate(buckets):
                count.put(i)
                pool.submit(writer.write_preloaded_data, transform_list, i, bucket, done, count, True,
                            use_msc=use_msc)
        got: dict | Exception = {}
        while not done.empty():
            i, out = done.get()
            if isinstance(out, Exception):
                got = out
                break
            got[i] = out
        if isinstance(got, dict) and len(got) != len(buckets):
            got = RuntimeError(f"{len(buckets) - len(got)} checkpoint writer threads gave no result")
        results.put(got)

    prepare = writer.prepare_write_data

    def prepare_write_data(self, plan, planner) -> None:
        prepare(self, plan, _ExactStorages(planner))

    fa._results_queue = fa._results_queue or queue.Queue()
    # write_preloaded_data opens its files with the builtin `open`, looked up in the module
    # first: the files keep the errno of a failed write (_WriteErrors)
    fa.open = _WriteErrors.open
    writer.write_preloaded_data_multiproc = staticmethod(write_buckets)
    writer.prepare_write_data = prepare_write_data
    writer._flexmarl_in_process = True
