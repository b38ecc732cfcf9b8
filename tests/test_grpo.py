import math

import numpy as np
import torch

from flexmarl_hpc.grpo import MicroBatch, group_advantages, grpo_loss, token_logprobs


def test_group_advantages_by_hand():
    adv = group_advantages(np.array([1.0, 0.0, 0.0, 1.0]))
    np.testing.assert_allclose(adv, [1, -1, -1, 1], atol=1e-5)   # mean .5, std .5
    adv = group_advantages(np.array([1.0, 0.0, 0.0, 0.0]))
    s = math.sqrt(0.1875)
    np.testing.assert_allclose(adv, [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s], rtol=1e-5)
    assert group_advantages(np.array([3.0])).tolist() == [0.0]
    assert np.all(group_advantages(np.array([2.0, 2.0])) == 0)


def _mb(stale=False):
    # one sample: prompt [1, 4], response [5, 6]; vocab 8
    return MicroBatch(input_ids=torch.tensor([[1, 4, 5, 6]]), prompt_lens=torch.tensor([2]),
                      response_lens=torch.tensor([2]),
                      behav_logprobs=torch.tensor([[0.0, 0.0, math.log(0.5), math.log(0.25)]]),
                      advantages=torch.tensor([2.0]), stale=torch.tensor([stale]), allowed=None)


def test_token_logprobs_and_loss_by_hand():
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 8, requires_grad=True)
    mb = _mb()
    logp, ent = token_logprobs(logits, mb, temperature=1.0)
    full = torch.log_softmax(logits, -1)
    assert torch.allclose(logp[0, 2], full[0, 1, 5]) and torch.allclose(logp[0, 3], full[0, 2, 6])
    assert logp[0, :2].abs().sum() == 0                    # prompt positions carry nothing
    h = -(full.exp() * full).sum(-1)
    assert torch.allclose(ent[0, 2:], h[0, 1:3])
    loss, stats = grpo_loss(logp, ent, mb, clip_eps=0.2, entropy_coef=0.1, tis_cap=2.0)
    # on-policy, one pass: ratio = 1, so loss = mean_t(-A - c * H_t)
    expect = (-2.0 - 0.1 * h[0, 1]) / 2 + (-2.0 - 0.1 * h[0, 2]) / 2
    assert torch.allclose(loss, expect)
    loss.backward()
    # gradient of the policy term is -A/T * grad(logp_t) summed over t
    g = logits.grad.clone()
    logits.grad = None
    ref = -(2.0 / 2) * (full[0, 1, 5] + full[0, 2, 6]) - 0.1 * (h[0, 1] + h[0, 2]) / 2
    ref.backward()
    torch.testing.assert_close(g, logits.grad)
    assert stats["samples"] == 1 and stats["tokens"] == 2


def test_stale_samples_get_truncated_importance_weights():
    logits = torch.zeros(1, 4, 8)                         # uniform: p = 1/8
    mb = _mb(stale=True)
    logp, ent = token_logprobs(logits, mb, temperature=1.0)
    loss, stats = grpo_loss(logp, ent, mb, clip_eps=0.2, entropy_coef=0.0, tis_cap=2.0)
    # w_t = min(p_now / p_behav, cap) = (1/8)/(1/2) = .25 and (1/8)/(1/4) = .5
    assert math.isclose(loss.item(), -2.0 * (0.25 + 0.5) / 2, rel_tol=1e-6)
    assert math.isclose(stats["tis_weight"], 0.375, rel_tol=1e-6)
    mb.behav_logprobs[0, 2] = math.log(0.01)               # p_now / p_behav = 12.5 -> capped at 2
    loss, _ = grpo_loss(logp, ent, mb, clip_eps=0.2, entropy_coef=0.0, tis_cap=2.0)
    assert math.isclose(loss.item(), -2.0 * (2.0 + 0.5) / 2, rel_tol=1e-6)


def test_ppo_clip_bites_when_ratio_moves():
    # with prox detached from a *different* forward (a second pass), the clip bounds the ratio
    logp = torch.tensor([[0.0, 0.0, math.log(0.5), math.log(0.5)]], requires_grad=True)
    mb = _mb()
    loss, _ = grpo_loss(logp, torch.zeros(1, 4), mb, clip_eps=0.2, entropy_coef=0.0, tis_cap=2.0)
    assert math.isclose(loss.item(), -2.0, rel_tol=1e-6)


def test_micro_batch_split_accumulates_to_the_same_gradient():
    torch.manual_seed(1)
    w = torch.randn(8, 8, requires_grad=True)
    ids = torch.randint(0, 8, (6, 5))
    mb = MicroBatch(ids, torch.full((6,), 2), torch.tensor([3, 2, 1, 3, 2, 3]), torch.zeros(6, 5),
                    torch.randn(6), torch.zeros(6, dtype=torch.bool), None)

    def grad(parts):
        w.grad = None
        for p in parts:
            sub = MicroBatch(*(getattr(mb, f)[p] if getattr(mb, f) is not None else None
                               for f in mb.__dataclass_fields__))
            logits = torch.nn.functional.one_hot(sub.input_ids, 8).float() @ w
            logp, ent = token_logprobs(logits, sub, 1.0)
            loss, _ = grpo_loss(logp, ent, sub, clip_eps=0.2, entropy_coef=0.01, tis_cap=2.0)
            (loss / 6).backward()
        return w.grad.clone()

    whole = grad([slice(0, 6)])
    split = grad([slice(0, 2), slice(2, 5), slice(5, 6)])
    torch.testing.assert_close(whole, split, rtol=1e-6, atol=1e-7)
