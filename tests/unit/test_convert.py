"""HF <-> megatron layout converter: pure tensor code, round trips bit for bit."""
import pytest
import torch

from flexmarl_hpc.learn.convert import hf_to_megatron, max_tensor_parallel, megatron_to_hf, padded_vocab
from flexmarl_hpc.learn.model import ModelArgs, build_model, hf_state_dict


def _hf(args: ModelArgs, seed: int = 3) -> dict[str, torch.Tensor]:
    hf = hf_state_dict(build_model(args, seed=seed))
    g = torch.Generator().manual_seed(seed)
    for k in hf:                       # build_model zeroes biases: make them visible
        if k.endswith("bias"):
            hf[k] = torch.randn(hf[k].shape, generator=g)
    return hf


def _shards(hf, args, tp, pp):
    return [[hf_to_megatron(hf, args, t, tp, p, pp) for t in range(tp)] for p in range(pp)]


@pytest.mark.parametrize("tie,bias", [(False, False), (True, False), (True, True), (False, True)])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_is_bit_identical(tp, pp, tie, bias):
    # vocab 37: not a multiple of 8 (nor of TP); qkv_bias: Qwen2's q/k/v biases
    args = ModelArgs(vocab_size=37, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                     intermediate_size=48, max_seq_len=16, tie_embeddings=tie, qkv_bias=bias)
    hf = _hf(args)
    shards = _shards(hf, args, tp, pp)
    assert shards[0][0]["embedding.word_embeddings.weight"].shape[0] == padded_vocab(args) // tp
    assert padded_vocab(args) == 128
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in shards[0][0]) == bias
    back = megatron_to_hf(shards, args)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


@pytest.mark.parametrize("vocab", [23, 49153])
def test_padded_vocab_does_not_depend_on_tp(vocab):
    """3 KV heads (SmolLM2-135M has them): TP1 and TP3 are legal, so Vp is a multiple of
    lcm(128, 3), the same at both; the TP3 vocab shards stacked are the TP1 tensor (what
    dist_checkpointing reshards), and TP3 round-trips bit for bit."""
    args = ModelArgs(vocab_size=vocab, hidden_size=24, num_layers=2, num_heads=6, num_kv_heads=3,
                     intermediate_size=36, max_seq_len=16, tie_embeddings=False, qkv_bias=True)
    assert max_tensor_parallel(args) == 3
    vp = padded_vocab(args)
    assert vp % 384 == 0 and vocab <= vp < vocab + 384
    hf = _hf(args)
    one = hf_to_megatron(hf, args)
    three = [hf_to_megatron(hf, args, t, 3) for t in range(3)]
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert one[key].shape[0] == vp
        assert torch.equal(torch.cat([s[key] for s in three]), one[key])
        assert not one[key][vocab:].any()             # padding rows are zero
    back = megatron_to_hf([three], args)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    with pytest.raises(ValueError, match="tp=2"):
        hf_to_megatron(hf, args, 0, 2)
    # shards of another padding (one row short here) are refused, not silently cut
    bad = {**three[0], "output_layer.weight": three[0]["output_layer.weight"][:-1]}
    with pytest.raises(ValueError, match="padded vocab"):
        megatron_to_hf([[bad, three[1], three[2]]], args)


def test_qkv_bias_layout_groups_like_the_weight():
    args = ModelArgs(vocab_size=8, hidden_size=8, num_layers=1, num_heads=4, num_kv_heads=2,
                     intermediate_size=8, max_seq_len=4, qkv_bias=True)
    hf = hf_state_dict(build_model(args, seed=0))
    hf["model.layers.0.self_attn.q_proj.bias"] = torch.arange(8.)
    hf["model.layers.0.self_attn.k_proj.bias"] = 100 + torch.arange(4.)
    hf["model.layers.0.self_attn.v_proj.bias"] = 200 + torch.arange(4.)
    key = "decoder.layers.0.self_attention.linear_qkv.bias"
    group0 = [0, 1, 2, 3, 100, 101, 200, 201]
    group1 = [4, 5, 6, 7, 102, 103, 202, 203]
    assert hf_to_megatron(hf, args)[key].tolist() == group0 + group1
    assert [hf_to_megatron(hf, args, t, 2)[key].tolist() for t in (0, 1)] == [group0, group1]


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


ARGS = ModelArgs(vocab_size=37, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                 intermediate_size=48, max_seq_len=16, tie_embeddings=False, qkv_bias=True)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_per_parameter_stream_equals_the_whole_model_converter(tp, pp, tie):
    """The sync's per-parameter conversion (one gathered parameter at a time, in
    sync_order) gives exactly megatron_to_hf's tensors, each once, with the shapes the plan
    announces (a tied output layer adds nothing)."""
    from dataclasses import replace
    from flexmarl_hpc.learn.convert import megatron_param_to_hf, sync_order, tp_split_dim
    args = replace(ARGS, tie_embeddings=tie)
    hf = _hf(args)
    shards = _shards(hf, args, tp, pp)
    got = {}
    for p in range(pp):
        order = sync_order(args, tp, p, pp)
        assert [n for n, _ in order] == list(shards[p][0])
        for name, outs in order:
            tps = [shards[p][t][name] for t in range(tp)] if tp_split_dim(name) is not None else [shards[p][0][name]]
            made = megatron_param_to_hf(name, tps, args, p, pp)
            assert [(k, tuple(v.shape)) for k, v in made] == outs
            for k, v in made:
                assert k not in got
                got[k] = v
    assert got.keys() == hf.keys() and all(torch.equal(got[k], hf[k]) for k in hf)


def test_init_tensors_are_build_model_one_tensor_at_a_time():
    from flexmarl_hpc.learn.model import init_tensors
    for tie in (False, True):
        from dataclasses import replace
        args = replace(ARGS, tie_embeddings=tie)
        whole = hf_state_dict(build_model(args, seed=11, std=0.05))
        streamed = dict(init_tensors(args, seed=11, std=0.05))
        assert streamed.keys() == whole.keys() and all(torch.equal(streamed[k], whole[k]) for k in whole)


@pytest.mark.parametrize("source", ["checkpoint", "init"])
def test_weight_source_gives_each_rank_its_slice_only(tmp_path, source):
    """A TP2 x PP2 rank's shard from a safetensors checkpoint (get_slice) or a seeded random
    init equals the converter's shard of the full weights; the reads it makes are the rank's
    own ranges (each a quarter or half of a tensor, never all of a split one)."""
    from flexmarl_hpc.learn.convert import shard_reads
    from flexmarl_hpc.learn.model import save_hf_checkpoint
    from flexmarl_hpc.learn.weights import WeightSource
    model = build_model(ARGS, seed=5, std=0.1)
    save_hf_checkpoint(model, tmp_path)
    full = hf_state_dict(model)
    src = WeightSource(checkpoint=str(tmp_path)) if source == "checkpoint" else WeightSource(seed=5, std=0.1)
    for t in range(2):
        for p in range(2):
            got, ref = src.shard(ARGS, t, 2, p, 2), hf_to_megatron(full, ARGS, t, 2, p, 2)
            assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    reads = shard_reads(ARGS, 1, 2, 1, 2)
    assert "model.embed_tokens.weight" not in reads and "model.layers.0.mlp.up_proj.weight" not in reads
    assert reads["model.layers.3.mlp.up_proj.weight"] == [(0, 24, 48)]          # its half of the rows
    assert reads["model.layers.3.self_attn.o_proj.weight"] == [(1, 16, 32)]     # its half of the columns
    assert "lm_head.weight" not in reads          # its vocab rows 64-127 are all padding (37 real)
    assert shard_reads(ARGS, 0, 2, 1, 2)["lm_head.weight"] == [(0, 0, 37)]


def _from_sources(tps: list[torch.Tensor], sources, rows: int, shape) -> torch.Tensor:
    """An HF row range assembled from TP shards by `hf_row_sources` (what the sync's gather
    does over the TP group), each output element written exactly once."""
    out = torch.full((rows, *shape[1:]), float("nan"))
    seen = torch.zeros(out.shape, dtype=torch.int64)
    for s in sources:
        part = tps[s.rank][s.lo:s.hi]
        at = (slice(s.out_lo, s.out_hi),) if s.col is None else \
            (slice(s.out_lo, s.out_hi), slice(s.col * part.shape[1], (s.col + 1) * part.shape[1]))
        out[at] = part
        seen[at] += 1
    assert seen.eq(1).all(), seen
    return out


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (4, 1)])
def test_row_sources_give_every_hf_row_range_bit_equal(tp, pp, tie):
    """Any row range [a, b) of any HF tensor, assembled from the TP shards where
    hf_row_sources says its rows lie (vocab rows across a shard boundary, q/k/v rows across
    query groups, gate/up rows across ranks, o_proj/down_proj column blocks), equals those rows
    of the HF tensor: what the sync gathers piece by piece is the whole-parameter conversion's."""
    from dataclasses import replace
    from flexmarl_hpc.learn.convert import hf_row_sources, sync_order, tp_split_dim
    args = replace(ARGS, num_heads=8, num_kv_heads=4, tie_embeddings=tie)
    hf = _hf(args)
    shards = _shards(hf, args, tp, pp)
    g = torch.Generator().manual_seed(1)
    checked = 0
    for p in range(pp):
        for name, outs in sync_order(args, tp, p, pp):
            tps = [shards[p][t][name] for t in range(tp if tp_split_dim(name) is not None else 1)]
            for hf_name, shape in outs:
                n = shape[0]
                cuts = {(0, n), (0, 1), (n - 1, n)} | {tuple(sorted(torch.randint(0, n + 1, (2,), generator=g).tolist()))
                                                       for _ in range(6)}
                for a, b in (c for c in cuts if c[0] < c[1]):
                    got = _from_sources(tps, hf_row_sources(name, hf_name, args, tp, a, b), b - a, shape)
                    assert torch.equal(got, hf[hf_name][a:b]), (hf_name, a, b)
                    checked += 1
    assert checked > 100
