"""Structural tests of the vLLM engine manager with a fake `vllm` module (no vLLM, no GPU here):
how many engines a replica holds after rebinding among agents of the same / different
architectures, and what the engines are built with (dtype, memory, TP, sleep mode).
The fake LLM records its kwargs and every call; the real API it mirrors is vLLM's
`LLM(..., enable_sleep_mode=True)`, `sleep(level=)`, `wake_up(tags=)`, `collective_rpc`."""
from __future__ import annotations

import pickle
import sys
import types
from dataclasses import replace

import pytest
import torch

from flexmarl_hpc.config.schema import ConfigError, RolloutConfig
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.learn.model import ModelArgs, build_model, hf_state_dict
from flexmarl_hpc.rollout.base import GenRequest
from flexmarl_hpc.runtime.deadline import CollectiveTimeout
from flexmarl_hpc.learn.sampling import SamplingParams

SMALL = ModelArgs(vocab_size=19, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
                  intermediate_size=48, max_seq_len=16)
BIG = replace(SMALL, num_layers=3)


class FakeWorker:
    """Stands in for a vLLM GPU worker of TP rank `tp_rank`: the real SyncWorker methods are
    mixed in (as vLLM's worker_extension_cls does) and run against a recording model."""

    def __init__(self, tp_rank: int):
        self.tp_rank, self.loaded = tp_rank, []
        self.device = torch.device("cpu")
        self.model_runner = types.SimpleNamespace(model=types.SimpleNamespace(
            load_weights=lambda weights: self.loaded.append({k: v.clone() for k, v in weights})))


class FakeLLM:
    built: list["FakeLLM"] = []

    def __init__(self, model: str, **kwargs):
        from flexmarl_hpc.rollout import vllm_engine
        self.model, self.kwargs, self.calls = model, kwargs, []
        self.awake = True
        ext = kwargs["worker_extension_cls"]
        assert ext == "flexmarl_hpc.rollout.vllm_engine.SyncWorker"
        cls = type("Worker", (FakeWorker, vllm_engine.SyncWorker), {})
        self.workers = [cls(r) for r in range(kwargs["tensor_parallel_size"])]
        FakeLLM.built.append(self)

    def sleep(self, level: int = 1):
        self.calls.append(("sleep", level))
        self.awake = False

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags or ())))
        self.awake = True

    def collective_rpc(self, method, args=()):
        """Calls `method` on every worker, as vLLM does; arguments crossing to workers in other
        processes are pickled, so they must be small (headers, never weights) for TP > 1."""
        assert isinstance(method, str), "pass the extension method's name"
        if len(self.workers) > 1:
            size = len(pickle.dumps(args))
            assert size < 4096, f"{method}: {size} bytes pickled to the TP workers"
        if method != "flexmarl_join":
            assert self.awake, "weights loaded into a sleeping engine"
        self.calls.append((method, args))
        if method == "flexmarl_load":
            self.calls[-1] = ("reload", dict(args[0])["model.norm.weight"].clone())
            return [None]
        out = []
        for w in self.workers:        # each worker runs it as its own TP rank
            _CURRENT_TP_RANK.append(w.tp_rank)
            try:
                out.append(getattr(w, method)(*args))
            finally:
                _CURRENT_TP_RANK.pop()
        return out

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, sps, use_tqdm=False):
        assert self.awake and sum(e.awake for e in FakeLLM.built) == 1 or not self.kwargs.get(
            "enable_sleep_mode"), "two engines awake at once"
        self.calls.append(("generate", len(prompts)))
        self.sampling = list(sps)                  # the SamplingParams each prompt got
        tok = types.SimpleNamespace(logprob=-0.5)
        out = types.SimpleNamespace(token_ids=[3], logprobs=[{3: tok}])
        return [types.SimpleNamespace(outputs=[out]) for _ in prompts]


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.LLM = FakeLLM
    vllm.SamplingParams = lambda **kw: kw
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda **kw: kw
    vllm.inputs = inputs
    dist = types.ModuleType("vllm.distributed")
    dist.get_tensor_model_parallel_rank = lambda: _CURRENT_TP_RANK[-1]
    vllm.distributed = dist
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setitem(sys.modules, "vllm.distributed", dist)
    FakeLLM.built = []
    return FakeLLM


_CURRENT_TP_RANK = [0]


class Task:
    stop_tokens = frozenset({2})

    def allowed_tokens(self, turn):
        return None


def weights(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    named = hf_state_dict(build_model(args, seed=seed))
    named["model.norm.weight"] = torch.full_like(named["model.norm.weight"], float(seed))  # a fingerprint
    return named


def gen(engine, agent):
    req = GenRequest("s", [1, 4], seed=0, max_new_tokens=2, turn=0)
    return engine.generate(agent, [req], SamplingParams(1.0, 1.0))


def reloads(llm) -> list[float]:
    return [float(c[1][0]) for c in llm.calls if c[0] == "reload"]


def make(args_of, tmp_path, cuda, **cfg):
    from flexmarl_hpc.rollout.vllm_engine import VLLMEngine
    mem = cfg.pop("gpu_memory_gb", 0.0)
    return VLLMEngine(args_of, Task(), RolloutConfig(backend="vllm", max_batch=4, **cfg),
                      workdir=str(tmp_path), cuda=cuda, gpu_memory_gb=mem, bucket_bytes=1 << 30)


@pytest.mark.parametrize("cuda", [False, True])
def test_same_architecture_shares_one_engine_switched_by_a_load(fake_vllm, tmp_path, cuda):
    """One engine per architecture, started without weights (dummy load, config.json only on
    disk); a load of another agent overwrites the one it held, which is reported dropped (the
    orchestrator re-sends it): no host copies."""
    e = make({"a": SMALL, "b": SMALL}, tmp_path, cuda)
    e.load_weights("a", 1, weights(SMALL, 1))
    gen(e, "a")
    e.load_weights("b", 1, weights(SMALL, 2))
    assert e.take_dropped() == ["a"] and e.version("a") is None and e.version("b") == 1
    gen(e, "b")
    with pytest.raises(RuntimeError, match="a vNone is not loaded"):
        gen(e, "a")
    e.load_weights("a", 2, weights(SMALL, 3))       # re-sent
    gen(e, "a")
    assert len(fake_vllm.built) == 1 and len(e.engines) == 1
    llm = fake_vllm.built[0]
    assert llm.kwargs["load_format"] == "dummy"
    assert [p.name for p in (tmp_path.glob("*/*/*"))] == ["config.json"]   # nothing model-sized on disk
    assert reloads(llm) == [1.0, 2.0, 3.0]
    assert not any(c[0] in ("sleep", "wake_up") for c in llm.calls)
    assert not hasattr(e, "host")


def test_gpu_engines_of_different_architectures_sleep_one_awake(fake_vllm, tmp_path):
    e = make({"a": SMALL, "b": BIG, "c": SMALL}, tmp_path, cuda=True, gpu_memory_gb=16.0)
    e.load_weights("a", 1, weights(SMALL, 1))
    e.load_weights("b", 1, weights(BIG, 2))       # builds the second engine: a's sleeps first
    assert e.take_dropped() == ["a"]              # level 2: a's weights are gone
    e.load_weights("c", 1, weights(SMALL, 3))     # wakes the small engine: weights, load, KV
    assert e.take_dropped() == ["b"]
    gen(e, "c")
    assert len(fake_vllm.built) == 2 and len(e.engines) == 2
    small, big = fake_vllm.built
    for llm in (small, big):
        assert llm.kwargs["enable_sleep_mode"] is True
        # the pool's GPU minus a 1 GiB bucket (with 10% rounding) and one sync communicator's
        # NCCL buffers (688 MB; config/gpu_memory.py), floored to 4 digits
        assert llm.kwargs["gpu_memory_utilization"] == pytest.approx(1 - (2**30 * 1.1 + 688e6) / 16e9, abs=1e-4)
        assert llm.kwargs["dtype"] == "bfloat16" and llm.kwargs["tensor_parallel_size"] == 1
    assert ("sleep", 2) in small.calls and ("sleep", 2) in big.calls
    i = small.calls.index(("wake_up", ("weights",)))
    assert small.calls[i + 1][0] == "reload" and small.calls[i + 2] == ("wake_up", ("kv_cache",))
    assert reloads(small) == [1.0, 3.0]
    assert sum(llm.awake for llm in fake_vllm.built) == 1


def test_cpu_keeps_architectures_resident_without_sleep(fake_vllm, tmp_path):
    e = make({"a": SMALL, "b": BIG}, tmp_path, cuda=False)
    e.load_weights("a", 1, weights(SMALL, 1))
    e.load_weights("b", 1, weights(BIG, 2))
    gen(e, "a"), gen(e, "b"), gen(e, "a")
    assert len(fake_vllm.built) == 2 and e.take_dropped() == []
    for llm in fake_vllm.built:
        assert "enable_sleep_mode" not in llm.kwargs and "gpu_memory_utilization" not in llm.kwargs
        assert llm.kwargs["dtype"] == "float32"
        assert not any(c[0] in ("sleep", "wake_up") for c in llm.calls)


def test_a_requests_own_temperature_and_top_p_reach_its_vllm_sampling_params(fake_vllm, tmp_path):
    """An episode call's ctx.chat(temperature=, top_p=) travels as GenRequest.sampling: its
    prompt's vLLM SamplingParams carry them (processed log-probs: those of the distribution
    drawn from), the other prompts of the batch keep the batch's params."""
    e = make({"a": SMALL}, tmp_path, cuda=False)
    e.load_weights("a", 1, weights(SMALL, 1))
    reqs = [GenRequest("s0", [1, 4], 5, 2, 0, (0.3, 0.8)), GenRequest("s1", [1, 5], 6, 2, 0)]
    e.generate("a", reqs, SamplingParams(0.9, 1.0))
    got = [(sp["temperature"], sp["top_p"], sp["seed"]) for sp in fake_vllm.built[0].sampling]
    assert got == [(0.3, 0.8, 5), (0.9, 1.0, 6)]
    assert fake_vllm.built[0].kwargs["logprobs_mode"] == "processed_logprobs"


def test_dtype_and_tensor_parallel_reach_the_engine(fake_vllm, tmp_path):
    """The replica's GPU block (rollout.gpus_per_replica) is the engine's TP size."""
    e = make({"a": SMALL}, tmp_path, cuda=True, dtype="fp16", gpus_per_replica=2)
    e.remote("a")
    assert fake_vllm.built[0].kwargs["dtype"] == "float16"
    assert fake_vllm.built[0].kwargs["tensor_parallel_size"] == 2
    assert fake_vllm.built[0].kwargs["gpu_memory_utilization"] == 0.85    # pool memory unknown


class FakeWork:
    """A gloo send/recv Work: completion seen inside `wait(timeout)`, which raises gloo's
    timeout error if the transfer never came (the group here is gloo: no CUDA)."""

    def __init__(self, done: bool):
        self.done = done

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout=None) -> None:
        if not self.done:
            raise RuntimeError(f"[gloo] Timed out waiting {timeout} for recv operation to complete")


class FakeP2P:
    """A worker's (trainer group, pool) sync group: point-to-point sends land on a shared
    wire, receives take from it in order (the chain sender's bytes are put there first)."""
    wire: dict = {}
    sends: list = []
    joined: list = []
    hang = False                      # a receive that never completes (the link before gone)

    def __init__(self, store, rank, size):
        self.rank = rank
        FakeP2P.joined.append((rank, size))

    def recv(self, tensors, src, tag):
        q = FakeP2P.wire.get((src, self.rank), [])
        done = bool(q) and not FakeP2P.hang
        if done:
            tensors[0].copy_(q.pop(0))
        return FakeWork(done)

    def send(self, tensors, dst, tag):
        FakeP2P.wire.setdefault((self.rank, dst), []).append(tensors[0].clone())
        FakeP2P.sends.append((self.rank, dst))
        return FakeWork(True)


def _fake_p2p(monkeypatch):
    from flexmarl_hpc.rollout import vllm_engine
    from flexmarl_hpc.runtime import sync_channels as G
    FakeP2P.wire, FakeP2P.sends, FakeP2P.joined, FakeP2P.hang = {}, [], [], False
    timeouts = []
    monkeypatch.setattr(vllm_engine.torch.distributed, "TCPStore",
                        lambda *a, **k: vllm_engine.torch.distributed.HashStore())
    monkeypatch.setattr(G, "new_group", lambda backend, store, rank, size, timeout=None, device=None:
                        timeouts.append(timeout) or FakeP2P(store, rank, size))
    monkeypatch.setattr(G.SyncChannels, "_serve", lambda self: ("host", 1))
    return timeouts


def _join(ch, remote):
    """The replica's side of SyncChannels.open for a pair of this replica alone (one rank
    here): its engine's workers join at the pair's ranks of this member."""
    from mpi4py import MPI
    from flexmarl_hpc.runtime import sync_channels as G
    from flexmarl_hpc.runtime.deadline import Deadline
    pair = G.Pair((0, 0), (), (MPI.COMM_WORLD.Get_rank(),), MPI.COMM_SELF)
    ch._torch_group(pair, remote, Deadline(0))
    return pair


SENDER = 99                           # the chain's first link: a stage sender's rank


def test_tp2_replica_receives_on_every_worker_with_headers_only(fake_vllm, tmp_path, monkeypatch):
    """A TP2 replica in a weight sync: SyncChannels.open counts its two workers, both join
    the pair's group at distinct ranks, and each bucket reaches both workers as a small
    header: worker 0 receives it from the sender and forwards it to worker 1 (the chain),
    each into its own buffer, and each loads it."""
    from mpi4py import MPI
    from flexmarl_hpc.runtime import weight_sync as W
    timeouts, sent = _fake_p2p(monkeypatch), weights(SMALL, 4)
    e = make({"a": SMALL}, tmp_path, cuda=True, gpus_per_replica=2)
    remote = e.remote("a")
    llm = fake_vllm.built[0]
    ch = W.SyncChannels(MPI.COMM_WORLD, "gloo", timeout_s=42)
    pair = _join(ch, remote)
    assert sorted(FakeP2P.joined) == [(0, 2), (1, 2)]    # both TP workers, distinct ranks
    bucket = W.plan_buckets(W.layout_of(sent), 1 << 30)[0]
    payload = torch.empty(bucket.total, dtype=torch.uint8)
    W.pack(sent, bucket, payload)
    FakeP2P.wire[SENDER, 0] = [payload]
    links = (SENDER,) + tuple(pair.ranks(MPI.COMM_WORLD.Get_rank()))
    e.load_weights("a", 1, [W.RemoteBucket(pair.pg.prefix, bucket, None, links)])
    assert FakeP2P.sends == [(0, 1)]                      # worker 0 forwarded; the last link does not
    for w in llm.workers:             # each worker loaded the bucket it received itself
        got, = w.loaded
        assert all(torch.equal(got[k], sent[k]) for k in sent)
    recv = [c[1] for c in llm.calls if c[0] == "flexmarl_recv"]
    assert len(recv) == 1 and not any(isinstance(a, torch.Tensor) for a in recv[0])
    assert e.version("a") == 1
    # the sync's deadline in the workers: their group's timeout, and each bucket waited by
    # the seconds the replica has left (RemoteBucket.left_s)
    assert [t.total_seconds() for t in timeouts] == [42, 42]
    FakeP2P.hang = True
    with pytest.raises(CollectiveTimeout, match="vLLM TP worker"):
        e.load_weights("a", 2, [W.RemoteBucket(pair.pg.prefix, bucket, 0.2, links)])
    assert e.version("a") == 1
    ch.close()


def test_tp2_workers_load_a_split_tensor_whole_after_its_last_piece(fake_vllm, tmp_path, monkeypatch):
    """Tensors larger than a bucket (a third of the largest) reach each vLLM worker as pieces:
    the worker lands them in place in one buffer of the tensor and loads the tensor once,
    whole, after its last piece (vLLM's weight loaders shard whole tensors); bit-equal."""
    from mpi4py import MPI
    from flexmarl_hpc.runtime import weight_sync as W
    _fake_p2p(monkeypatch)
    sent = weights(SMALL, 4)
    buckets = W.plan_buckets(W.layout_of(sent), max(t.numel() * 4 for t in sent.values()) // 3)
    payloads, held, it = [], None, iter(sent.items())
    for b in buckets:                                     # the sender's bytes of each bucket
        payloads.append(torch.zeros(b.total, dtype=torch.uint8))
        held = W.fill_bucket(b, payloads[-1], it, held)
    split = {b.names[0] for b in buckets if b.piece is not None}
    assert "model.embed_tokens.weight" in split and len(buckets) > len(split) + 1
    FakeP2P.wire[SENDER, 0] = payloads
    e = make({"a": SMALL}, tmp_path, cuda=True, gpus_per_replica=2)
    ch = W.SyncChannels(MPI.COMM_WORLD, "gloo")
    pair = _join(ch, e.remote("a"))
    links = (SENDER,) + tuple(pair.ranks(MPI.COMM_WORLD.Get_rank()))
    e.load_weights("a", 1, [W.RemoteBucket(pair.pg.prefix, b, None, links) for b in buckets])
    for w in fake_vllm.built[0].workers:
        assert len(w.loaded) == sum(b.complete for b in buckets)      # no load of a partial tensor
        got = [(k, v) for part in w.loaded for k, v in part.items()]
        assert sorted(k for k, _ in got) == sorted(sent)                # each tensor loaded once
        assert all(torch.equal(v, sent[k]) for k, v in got)
        assert w._flexmarl_buffer.numel() == max(b.span for b in buckets)
    assert e.version("a") == 1
    ch.close()


def test_rollout_dtype_needs_vllm():
    with pytest.raises(ConfigError, match="rollout.dtype"):
        load_config("configs/local.yaml", ["rollout.dtype=bf16"])
    cfg = load_config("configs/local.yaml", ["rollout.dtype=bf16", "rollout.backend=vllm"])
    assert cfg.rollout.dtype == "bf16"
