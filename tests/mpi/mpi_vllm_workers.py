"""Run under mpiexec -n 2 by test_vllm_workers_mpi.py: the worker side of a TP2 vLLM replica's
weight sync, in processes spawned by an MPI rank, over gloo.

Rank 0 is a trainer leader that sends two versions of a small model (several buckets, tensors
split into pieces); rank 1 is a replica running the real VLLMEngine on its GPU path (its TP
workers receive: `remote`, `flexmarl_join`, RemoteBucket headers, `flexmarl_recv`), through
the real SyncChannels.open / workers.replica_sync. Its `vllm.LLM` is SpawnedLLM: one process per
TP rank started with multiprocessing 'spawn' (what vLLM's multiproc executor uses once the
replica has initialised CUDA), inheriting the rank's environment (MPICH's PMI variables
included), resolving `worker_extension_cls` by name and running each collective_rpc on
arguments unpickled in the worker. Not vLLM's here: the worker object (device cpu, a model
that records `load_weights`) and `get_tensor_model_parallel_rank`. A worker that imports
mpi4py dies in PMI_Init (exit 15), which ends this job.

Nothing MPI at the top: a spawned worker re-runs this file as `__mp_main__`.
"""
import importlib
import multiprocessing
import os
import sys
import tempfile
import time
import types

import torch

TP = 2
SHAPES = {"model.embed_tokens.weight": (40, 24), "model.layers.0.mlp.up_proj.weight": (24, 24),
          "model.layers.0.input_layernorm.weight": (24,), "model.norm.weight": (24,)}


def weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


class RecordingWorker:
    """What SyncWorker needs of vLLM's GPU worker: `device` and `model_runner.model`."""

    def __init__(self):
        self.device = torch.device("cpu")
        self.loaded: dict[str, torch.Tensor] = {}
        self.loads = 0
        model = types.SimpleNamespace(load_weights=self._record)
        self.model_runner = types.SimpleNamespace(model=model)

    def _record(self, weights):
        self.loads += 1
        self.loaded.update({k: v.clone() for k, v in weights})

    def report(self):
        """(loads, the tensors held, whether MPI was imported in this process)."""
        return self.loads, self.loaded, "mpi4py.MPI" in sys.modules


def serve(conn, tp_rank: int, extension: str) -> None:
    """A spawned TP worker: the extension class mixed into the worker, then each rpc in turn."""
    torch.set_num_threads(1)
    dist = types.ModuleType("vllm.distributed")
    dist.get_tensor_model_parallel_rank = lambda: tp_rank
    sys.modules.update({"vllm": types.ModuleType("vllm"), "vllm.distributed": dist})
    module, name = extension.rsplit(".", 1)
    worker = type("Worker", (RecordingWorker, getattr(importlib.import_module(module), name)), {})()
    while True:
        try:
            method, args = conn.recv()          # unpickling a header imports its classes' modules
        except EOFError:
            return
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except Exception as e:                  # back to the replica, as collective_rpc does
            conn.send(("error", f"TP worker {tp_rank}: {e!r}"))


class SpawnedLLM:
    """vllm.LLM as the engine uses it on GPUs: TP worker processes and collective_rpc."""

    def __init__(self, model: str, **kwargs):
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for r in range(kwargs["tensor_parallel_size"]):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=serve, args=(theirs, r, kwargs["worker_extension_cls"]), daemon=True)
            p.start()
            theirs.close()                      # a dead worker: EOFError on our end
            self.conns.append(mine)
            self.procs.append(p)

    def collective_rpc(self, method: str, args=()):
        for c in self.conns:                    # every worker at once (a join needs them all)
            c.send((method, args))
        out = []
        for r, (c, p) in enumerate(zip(self.conns, self.procs)):
            try:
                status, value = c.recv()
            except EOFError:
                p.join()
                raise RuntimeError(f"TP worker {r} died in {method} (exit {p.exitcode})") from None
            if status != "ok":
                raise RuntimeError(value)
            out.append(value)
        return out

    def reset_prefix_cache(self):
        pass


def main() -> None:
    from mpi4py import MPI

    from flexmarl_hpc.config.schema import RolloutConfig
    from flexmarl_hpc.config.sync_groups import SyncGroup
    from flexmarl_hpc.learn.model import ModelArgs
    from flexmarl_hpc.rollout.vllm_engine import VLLMEngine
    from flexmarl_hpc.runtime import messages
    from flexmarl_hpc.runtime.timing import WorkerClock
    from flexmarl_hpc.runtime.weight_sync import SyncPlan, SyncChannels, layout_of, plan_buckets, send_weights
    from flexmarl_hpc.ranks.workers import replica_sync

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    groups = [SyncGroup(0, 0, (0,), (1,), ("a",))]
    channels = SyncChannels(world, "gloo", timeout_s=30)
    if rank == 0:
        channels.open(groups)
        for version in (1, 2):
            named = weights(version)
            plan = SyncPlan((0,), (plan_buckets(layout_of(named), 1024),))     # pieces of the embedding
            send_weights(channels, (1,), plan, version, 0, named.items(), leader=True)
    else:
        sys.modules["vllm"] = types.SimpleNamespace(LLM=SpawnedLLM)
        args = ModelArgs(vocab_size=40, hidden_size=24, num_layers=1, num_heads=2, num_kv_heads=2,
                         intermediate_size=24, max_seq_len=16)
        engine = VLLMEngine({"a": args}, None, RolloutConfig(backend="vllm", max_batch=2, gpus_per_replica=TP),
                            cuda=True, workdir=tempfile.mkdtemp())
        channels.open(groups, lambda g: engine.remote(g.agents[0]))
        for version in (1, 2):
            got = replica_sync(channels, engine, messages.Sync("a", version, (0, 1)), 0, WorkerClock(),
                               [time.time()])
            assert got == version and engine.version("a") == version
            check(engine.engines, version)
        print(f"replica: {TP} spawned TP workers joined over gloo and loaded v1, v2 bit-equal", flush=True)
        engine.close()
    channels.close()


def check(engines, version: int) -> None:
    """Every TP worker holds `version`'s weights bit-equal and never imported mpi4py."""
    (eng,) = engines.values()
    sent = weights(version)
    for r, (loads, held, mpi) in enumerate(eng.llm.collective_rpc("report")):
        assert not mpi, f"TP worker {r} imported mpi4py.MPI"
        assert sorted(held) == sorted(sent) and all(torch.equal(held[k], sent[k]) for k in sent), (r, version)
        assert loads >= version, (r, loads)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
