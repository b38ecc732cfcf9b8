"""Batched sampling with a KV cache and per-sample seeds.

Every sample draws its random numbers from its own generator, seeded from
(run seed, agent, policy version, sample_id), so a sample's tokens do not depend on which
replica ran it or on what else was in its batch (up to float summation order of the batch's
matmuls, which only matters for a draw that lands exactly on a CDF boundary).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from flexmarl_hpc.learn.model import CausalLM, KVCache


def sample_seed(seed: int, agent: str, version: int, sample_id: str) -> int:
    """A 63-bit seed from the sample's identity (stable across processes and Python versions)."""
    h = hashlib.blake2b(f"{seed}|{agent}|{version}|{sample_id}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    """0: greedy (the most likely allowed token; evaluation). Log-probs are then at temperature 1."""
    top_p: float = 1.0


@dataclass
class Generation:
    tokens: list[int]
    logprobs: list[float]


def masked_logits(logits: torch.Tensor, allowed: torch.Tensor | None,
                  temperature: float | torch.Tensor) -> torch.Tensor:
    """The logits both sampling and training score tokens with: temperature (one, or [B, 1]
    one per row), then action mask."""
    logits = logits.float() / temperature
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    return logits


def draw(logprobs: torch.Tensor, u: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one token per row from log-probs [B, V] with uniforms u [B];
    `top_p` one value or one per row. Each row is drawn on its own (a row with top_p 1
    draws the same token whether or not a nucleus row shares its batch)."""
    probs = logprobs.exp()
    tp = torch.as_tensor(top_p, dtype=probs.dtype).expand(probs.shape[0])
    cdf = probs.cumsum(-1)
    tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=probs.shape[1] - 1).squeeze(1)
    nucleus = tp < 1.0
    if nucleus.any():
        sp, idx = probs[nucleus].sort(dim=-1, descending=True)
        keep = (sp.cumsum(-1) - sp) < tp[nucleus][:, None]          # always keeps the top token
        sp = sp * keep
        cdf = sp.cumsum(-1)
        pick = torch.searchsorted(cdf, (u[nucleus] * cdf[:, -1])[:, None], right=True).clamp(max=cdf.shape[1] - 1)
        tok[nucleus] = idx.gather(1, pick).squeeze(1)
    return tok


def row_params(params: SamplingParams | list[SamplingParams], B: int) -> tuple[torch.Tensor, ...]:
    """(temperature [B, 1], top_p [B], greedy [B]) of a batch from one SamplingParams for all
    or one per row; a greedy row (temperature 0) scores its log-probs at temperature 1."""
    rows = params if isinstance(params, list) else [params] * B
    if len(rows) != B:
        raise ValueError(f"{len(rows)} sampling params for a batch of {B}")
    temp = torch.tensor([[float(p.temperature)] for p in rows])
    greedy = temp[:, 0] == 0
    return torch.where(greedy[:, None], 1.0, temp), torch.tensor([float(p.top_p) for p in rows]), greedy


@torch.no_grad()
def generate(model: CausalLM, prompts: list[list[int]], seeds: list[int], max_new_tokens: list[int],
             params: SamplingParams | list[SamplingParams], pad_id: int, stop_ids: frozenset[int] = frozenset(),
             allowed: list[torch.Tensor | None] | None = None) -> list[Generation]:
    """Sample a response for every prompt in one batch (left padding, KV cache).

    `params`: one for the batch, or one per prompt (an episode call's own temperature); each
    sample's log-probs are of the distribution it was drawn from (its temperature, then
    the action mask). `allowed[i]` optionally restricts sample i to a boolean vocab mask
    (action masking).
    """
    B = len(prompts)
    if B == 0:
        return []
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    lp = max(len(p) for p in prompts)
    steps = max(max_new_tokens)
    if lp + steps > model.args.max_seq_len:
        raise ValueError(f"prompt ({lp}) + max_new_tokens ({steps}) exceeds model max_seq_len "
                         f"({model.args.max_seq_len})")
    ids = torch.full((B, lp), pad_id, dtype=torch.long)
    mask = torch.zeros(B, lp, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, lp - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, lp - len(p):] = True
    V = model.args.vocab_size
    allow = None
    if allowed is not None and any(a is not None for a in allowed):
        allow = torch.stack([a if a is not None else torch.ones(V, dtype=torch.bool) for a in allowed])
    limit = torch.tensor(max_new_tokens)
    cache = KVCache(model.args, B, lp + steps)
    logits = model(ids, mask, cache)[:, -1]
    out_tok = torch.full((B, steps), pad_id, dtype=torch.long)
    out_lp = torch.zeros(B, steps)
    live = torch.ones(B, dtype=torch.bool)
    temp, top_p, greedy = row_params(params, B)
    for t in range(steps):
        logp = torch.log_softmax(masked_logits(logits, allow, temp), dim=-1)
        if greedy.all():
            tok = logp.argmax(-1)
        else:
            u = torch.cat([torch.rand(1, generator=g) for g in gens])
            tok = torch.where(greedy, logp.argmax(-1), draw(logp, u, top_p))
        out_tok[:, t] = torch.where(live, tok, pad_id)
        out_lp[:, t] = logp.gather(1, tok[:, None]).squeeze(1)
        stopped = torch.tensor([int(x) in stop_ids for x in tok]) if stop_ids else torch.zeros(B, dtype=torch.bool)
        live = live & ~stopped & (t + 1 < limit)
        if not live.any() or t + 1 == steps:
            break
        logits = model(torch.where(live, tok, pad_id)[:, None], live[:, None], cache)[:, -1]
    results = []
    for i in range(B):
        n = int(min(limit[i], steps))
        toks = out_tok[i, :n].tolist()
        for j, x in enumerate(toks):      # cut after the first stop token
            if x in stop_ids:
                n = j + 1
                break
        results.append(Generation(out_tok[i, :n].tolist(), out_lp[i, :n].tolist()))
    return results
