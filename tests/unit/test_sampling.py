import torch

from flexmarl_hpc.learn.model import ModelArgs, build_model
from flexmarl_hpc.learn.sampling import SamplingParams, draw, generate, sample_seed

ARGS = ModelArgs(vocab_size=30, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4,
                 intermediate_size=64, max_seq_len=32)


def test_seed_depends_on_identity_only():
    a = sample_seed(0, "speaker", 3, "5_0_1")
    assert a == sample_seed(0, "speaker", 3, "5_0_1")
    assert len({a, sample_seed(1, "speaker", 3, "5_0_1"), sample_seed(0, "listener", 3, "5_0_1"),
                sample_seed(0, "speaker", 4, "5_0_1"), sample_seed(0, "speaker", 3, "5_0_2")}) == 5


def test_samples_do_not_depend_on_batch_composition():
    model = build_model(ARGS, seed=0).eval()
    prompts = [[1, 5, 6], [1, 7], [1, 8, 9, 10], [1, 4]]
    seeds = [11, 12, 13, 14]
    p = SamplingParams(temperature=1.0, top_p=0.9)
    together = generate(model, prompts, seeds, [6] * 4, p, pad_id=0, stop_ids=frozenset({2}))
    alone = [generate(model, [pr], [s], [6], p, pad_id=0, stop_ids=frozenset({2}))[0]
             for pr, s in zip(prompts, seeds)]
    shuffled = generate(model, prompts[::-1], seeds[::-1], [6] * 4, p, pad_id=0, stop_ids=frozenset({2}))[::-1]
    for a, b, c in zip(together, alone, shuffled):
        assert a.tokens == b.tokens == c.tokens
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_logprobs_match_a_full_forward_and_stop_tokens_cut():
    model = build_model(ARGS, seed=2).eval()
    gens = generate(model, [[1, 3, 4]] * 8, list(range(8)), [5] * 8, SamplingParams(), pad_id=0,
                    stop_ids=frozenset({5, 6, 7}))
    for g in gens:
        assert len(g.tokens) <= 5
        assert all(t not in (5, 6, 7) for t in g.tokens[:-1])
        seq = torch.tensor([[1, 3, 4] + g.tokens])
        with torch.no_grad():
            lp = torch.log_softmax(model(seq)[0], -1)
        ref = [lp[2 + j, t].item() for j, t in enumerate(g.tokens)]
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(ref), atol=1e-5, rtol=0)


def test_action_mask_and_top_p():
    model = build_model(ARGS, seed=2).eval()
    allowed = torch.zeros(30, dtype=torch.bool)
    allowed[[10, 11, 12]] = True
    gens = generate(model, [[1, 3]] * 16, list(range(16)), [3] * 16, SamplingParams(), pad_id=0,
                    allowed=[allowed] * 16)
    assert all(t in (10, 11, 12) for g in gens for t in g.tokens)
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    # top_p 0.6 keeps the 2 most likely tokens: u near 1 picks the second, never the third
    assert draw(logp, torch.tensor([0.99]), 0.6).item() == 1
    assert draw(logp, torch.tensor([0.1]), 0.6).item() == 0
    assert draw(logp, torch.tensor([0.99]), 1.0).item() == 2


def test_each_row_samples_at_its_own_temperature_and_keeps_that_distributions_logprobs():
    """Per-row params (an episode call's own temperature / top_p): each row draws what it
    draws alone with those params as the batch's, and its log-probs are of the distribution
    it was drawn from (logits / its temperature), the behaviour log-probs the trainer's
    importance weight divides by; at temperature 1 they would be others."""
    model = build_model(ARGS, seed=3).eval()
    prompts, seeds = [[1, 5, 6], [1, 7], [1, 8, 9], [1, 4]], [21, 22, 23, 24]
    rows = [SamplingParams(0.5, 1.0), SamplingParams(1.0, 0.8), SamplingParams(0.0, 1.0), SamplingParams(2.0, 1.0)]
    together = generate(model, prompts, seeds, [6] * 4, rows, pad_id=0, stop_ids=frozenset({2}))
    for pr, s, p, g in zip(prompts, seeds, rows, together):
        alone = generate(model, [pr], [s], [6], p, pad_id=0, stop_ids=frozenset({2}))[0]
        assert g.tokens == alone.tokens
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
        with torch.no_grad():
            logits = model(torch.tensor([pr + g.tokens]))[0]
        at = lambda t: [torch.log_softmax(logits[len(pr) - 1 + j] / t, -1)[tok].item() for j, tok in enumerate(g.tokens)]
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(at(p.temperature or 1.0)), atol=1e-5, rtol=0)
        if p.temperature not in (0.0, 1.0):
            assert max(abs(a - b) for a, b in zip(g.logprobs, at(1.0))) > 1e-3
