"""HF <-> megatron layout converter: pure tensor code, round trips bit for bit."""
import pytest
import torch

from flexmarl_hpc.convert import hf_to_megatron, megatron_to_hf, padded_vocab
from flexmarl_hpc.model import ModelArgs, build_model, hf_state_dict


@pytest.mark.parametrize("tie,bias", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_is_bit_identical(tp, pp, tie, bias):
    args = ModelArgs(vocab_size=37, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                     intermediate_size=48, max_seq_len=16, tie_embeddings=tie, qkv_bias=bias)
    hf = hf_state_dict(build_model(args, seed=3))
    shards = [[hf_to_megatron(hf, args, t, tp, p, pp) for t in range(tp)] for p in range(pp)]
    assert shards[0][0]["embedding.word_embeddings.weight"].shape[0] == padded_vocab(37, tp) // tp
    assert padded_vocab(37, tp) == 128          # TP-independent: checkpoints reshard
    if bias:                           # build_model zeroes biases: make them visible
        for k in hf:
            if k.endswith("bias"):
                hf[k] = torch.randn(hf[k].shape)
        shards = [[hf_to_megatron(hf, args, t, tp, p, pp) for t in range(tp)] for p in range(pp)]
    back = megatron_to_hf(shards, args)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_qkv_layout_groups_queries_with_their_kv_head():
    args = ModelArgs(vocab_size=8, hidden_size=8, num_layers=1, num_heads=4, num_kv_heads=2,
                     intermediate_size=8, max_seq_len=4)
    hd = 2
    hf = hf_state_dict(build_model(args, seed=0))
    hf["model.layers.0.self_attn.q_proj.weight"] = torch.arange(8.)[:, None].repeat(1, 8)
    hf["model.layers.0.self_attn.k_proj.weight"] = 100 + torch.arange(4.)[:, None].repeat(1, 8)
    hf["model.layers.0.self_attn.v_proj.weight"] = 200 + torch.arange(4.)[:, None].repeat(1, 8)
    qkv = hf_to_megatron(hf, args)["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0]
    # group 0: q heads 0,1 (rows 0-3), k head 0, v head 0; then group 1
    assert qkv.tolist() == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    assert hd == args.head_dim
