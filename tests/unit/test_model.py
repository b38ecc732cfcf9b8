import torch

from flexmarl_hpc.learn.model import KVCache, ModelArgs, build_model, load_hf_checkpoint, save_hf_checkpoint

ARGS = ModelArgs(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=64, max_seq_len=32, tie_embeddings=False)


def test_kv_cache_matches_full_forward_with_left_padding():
    model = build_model(ARGS, seed=1).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 40, (n,), generator=g) for n in (5, 9, 7)]
    L = max(len(s) for s in seqs)
    prompt_len = 3                                       # prefill 3 real tokens, decode the rest
    with torch.no_grad():
        # reference: each sequence alone, no cache, no padding
        ref = [model(s[None])[0] for s in seqs]
        # cached: left-padded prefill of the first `prompt_len` tokens, then one token a step
        B, P = len(seqs), prompt_len + (L - min(len(s) for s in seqs))
        pad_front = [L - len(s) for s in seqs]
        ids = torch.zeros(B, L, dtype=torch.long)
        mask = torch.zeros(B, L, dtype=torch.bool)
        for i, s in enumerate(seqs):
            ids[i, pad_front[i]:] = s
            mask[i, pad_front[i]:] = True
        cache = KVCache(ARGS, B, L)
        first = 6                                           # prefill columns [0, first)
        out = [model(ids[:, :first], mask[:, :first], cache)]
        for t in range(first, L):
            out.append(model(ids[:, t:t + 1], mask[:, t:t + 1], cache))
        logits = torch.cat(out, 1)
    for i, s in enumerate(seqs):
        got = logits[i, pad_front[i]:]
        torch.testing.assert_close(got, ref[i], rtol=1e-5, atol=1e-5)


def test_gqa_and_tied_heads_build(tmp_path):
    tied = ModelArgs(**{**ARGS.__dict__, "tie_embeddings": True})
    model = build_model(tied, seed=3)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_hf_checkpoint(model, tmp_path / "ckpt")
    again = load_hf_checkpoint(tmp_path / "ckpt")
    x = torch.randint(0, 40, (2, 6))
    with torch.no_grad():
        assert torch.equal(model(x), again(x))


def test_hf_names():
    names = set(build_model(ARGS, seed=0).state_dict())
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.mlp.gate_proj.weight", "model.layers.0.post_attention_layernorm.weight",
            "model.norm.weight", "lm_head.weight"} <= names
