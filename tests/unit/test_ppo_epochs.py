"""trainer.ppo_epochs: the PPO clip by hand, the replay on a real TorchTrainer against the
same updates done by hand, the config bounds (real runs: tests/e2e/test_ppo_epochs_e2e.py)."""
import copy
import math

import pytest
import torch
from mpi4py import MPI

from flexmarl_hpc.config.schema import ConfigError, TrainerConfig
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.learn.grpo import MicroBatch, grpo_loss, stat_values, token_logprobs
from flexmarl_hpc.learn.model import CausalLM, ModelArgs
from flexmarl_hpc.trainer.base import finish_step
from flexmarl_hpc.trainer.torch_trainer import TorchTrainer
from tests.conftest import ROOT

L = math.log


def _two_samples():
    """Two one-prompt samples of 2 response tokens (vocab 8): A = +1 and A = -1."""
    return MicroBatch(input_ids=torch.tensor([[1, 4, 5, 6], [1, 4, 2, 3]]), prompt_lens=torch.tensor([2, 2]),
                      response_lens=torch.tensor([2, 2]), behav_logprobs=torch.zeros(2, 4),
                      advantages=torch.tensor([1.0, -1.0]), stale=torch.zeros(2, dtype=torch.bool),
                      allowed=None)


@pytest.mark.parametrize("eps", [0.1, 0.3])
def test_clip_changes_the_loss_by_hand(eps):
    """Ratios (current / old) 1.25 and 0.8 on the A=+1 sample, 1.25 and 0.8 on the A=-1 one:
    PPO's min keeps 1.25 -> 1+eps (A>0: capped gain) and 0.8 (A>0: full loss) on the first;
    1.25 (A<0: full penalty) and 0.8 -> 1-eps (A<0: capped gain) on the second. w = 1
    (old = behaviour), so the loss is exact and differs between eps 0.1 and 0.3."""
    mb = _two_samples()
    old = torch.tensor([[0, 0, L(0.4), L(0.5)], [0, 0, L(0.4), L(0.5)]])
    mb.behav_logprobs = old.clone()
    mb.old_logprobs = old.clone()
    logp = torch.tensor([[0, 0, L(0.5), L(0.4)], [0, 0, L(0.5), L(0.4)]], requires_grad=True)
    loss, stats = grpo_loss(logp, torch.zeros(2, 4), mb, clip_eps=eps, entropy_coef=0.0, tis_cap=2.0)
    r_hi, r_lo = 1.25, 0.8
    s0 = -(min(r_hi, 1 + eps) + min(r_lo, max(r_lo, 1 - eps))) / 2          # A = +1
    s1 = -(-max(r_hi, min(r_hi, 1 + eps)) - max(r_lo, 1 - eps)) / 2          # A = -1
    # eps 0.1: s0 = -(1.1 + 0.8)/2, s1 = (1.25 + 0.9)/2; eps 0.3: s0 = -(1.25 + 0.8)/2, s1 = (1.25 + 0.8)/2
    want = {0.1: -(1.1 + 0.8) / 2 + (1.25 + 0.9) / 2, 0.3: 0.0}[eps]
    assert math.isclose(s0 + s1, want, abs_tol=1e-12)
    assert math.isclose(loss.item(), want, abs_tol=1e-6), (eps, loss.item())
    st = stat_values(stats)
    # clipped tokens: eps 0.1 -> one per sample (1/2 + 1/2); eps 0.3 -> none
    assert math.isclose(st["clip_frac"], {0.1: 1.0, 0.3: 0.0}[eps], abs_tol=1e-6)
    kl = (L(0.4) - L(0.5) + L(0.5) - L(0.4)) / 2 * 2                       # k1, summed over samples
    assert math.isclose(st["ppo_kl"], kl, abs_tol=1e-6)
    loss.backward()
    # a clipped token has no gradient; the others -A w r / T (d r / d logp = r)
    g = logp.grad
    if eps == 0.1:
        torch.testing.assert_close(g[:, 2:], torch.tensor([[0.0, -0.4], [0.625, 0.0]]))
    else:
        torch.testing.assert_close(g[:, 2:], torch.tensor([[-0.625, -0.4], [0.625, 0.4]]))


def test_one_pass_never_clips():
    """Without old log-probs the ratio is exactly 1: no clip, whatever eps."""
    mb = _two_samples()
    logp = torch.tensor([[0, 0, L(0.5), L(0.4)], [0, 0, L(0.5), L(0.4)]])
    _, stats = grpo_loss(logp, torch.zeros(2, 4), mb, clip_eps=1e-3, entropy_coef=0.0, tis_cap=50.0)
    st = stat_values(stats)
    assert st["clip_frac"] == 0 and st["ppo_kl"] == 0


ARGS = ModelArgs(vocab_size=8, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2,
                 intermediate_size=32, max_seq_len=8)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 6
    return MicroBatch(torch.randint(0, 8, (B, T), generator=g), torch.full((B,), 2), torch.tensor([4, 3, 2, 4]),
                      -2.0 + 0.1 * torch.randn(B, T, generator=g), torch.tensor([1.0, -1.0, 0.5, -0.5]),
                      torch.zeros(B, dtype=torch.bool), None)


def _trainer(epochs, model):
    cfg = TrainerConfig(lr=0.05, ppo_epochs=epochs, clip_eps=0.05, grad_clip=0.0, entropy_coef=0.01)
    return TorchTrainer(model, cfg, MPI.COMM_SELF, temperature=1.0)


def test_two_epochs_are_two_updates_against_the_pass_one_policy():
    """ppo_epochs=2 on TorchTrainer through finish_step (as the trainer loop runs it): two
    Adam updates, one version bump, a non-zero clip fraction from the second pass; and the
    weights equal two steps done by hand where pass 2's loss uses pass 1's log-probs as
    old_logp (not the behaviour log-probs, not the log-probs after the first update)."""
    torch.manual_seed(0)
    model = CausalLM(ARGS)
    hand = copy.deepcopy(model)
    tr = _trainer(2, model)
    mbs = [_batch(1), _batch(2)]
    N = sum(len(m) for m in mbs)
    acc = {}
    for i, mb in enumerate(mbs):
        for k, v in tr.forward_backward(mb, 1.0 / N, last=i == 1).items():
            acc[k] = acc.get(k, 0.0) + v
    assert len(tr.kept) == 2
    stats = finish_step(tr, 2, acc, group_sum=lambda d: d)
    assert tr.version == 1 and tr.kept == []
    assert all(int(s["step"]) == 2 for s in tr.opt.state.values())           # two Adam updates
    assert stats["clip_frac"] > 0 and stats["ppo_kl"] != 0 and acc["clip_frac"] == 0
    assert stats["loss"] == acc["loss"]                                       # pass 1's loss

    # by hand: the same two updates
    opt = torch.optim.AdamW([p for p in hand.parameters()], lr=0.05, betas=(0.9, 0.999), weight_decay=0.0)
    old = []
    for epoch in range(2):
        for i, mb in enumerate(mbs):
            logp, ent = token_logprobs(hand(mb.input_ids), mb, 1.0)
            if epoch == 0:
                old.append(logp.detach())
            loss, _ = grpo_loss(logp, ent, mb, clip_eps=0.05, entropy_coef=0.01, tis_cap=2.0,
                                old_logp=old[i] if epoch else None)
            (loss / N).backward()
        opt.step()
        opt.zero_grad()
    for (n, a), b in zip(model.named_parameters(), hand.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)


def test_one_epoch_keeps_nothing_and_steps_once():
    torch.manual_seed(0)
    tr = _trainer(1, CausalLM(ARGS))
    acc = tr.forward_backward(_batch(1), 0.25)
    assert tr.kept == []
    stats = finish_step(tr, 1, acc, group_sum=lambda d: d)
    assert tr.version == 1 and stats["clip_frac"] == 0
    assert all(int(s["step"]) == 1 for s in tr.opt.state.values())


@pytest.mark.parametrize("value", ["0", "17"])
def test_ppo_epochs_out_of_range_is_named(value):
    with pytest.raises(ConfigError, match=r"trainer\.ppo_epochs.*1\.\.16"):
        load_config(ROOT / "configs/local.yaml", [f"trainer.ppo_epochs={value}"])
