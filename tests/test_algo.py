"""Advantage estimators and losses against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rltrain.algo.advantages import compute_advantages
from rltrain.algo.losses import PolicyLossConfig, aggregate, kl_penalty, policy_loss

# One group of 4 samples with rewards 1, 0, 0, 1 and one of 2 samples with 1, 0.
R1 = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
MASK4 = torch.ones(4, 3)


def test_grpo_normalises_by_unbiased_group_std():
    adv = compute_advantages("grpo", R1, MASK4, eps=0.0)
    # mean 0.5, unbiased std sqrt(((.5^2) * 4) / 3) = sqrt(1/3)
    expect = 0.5 / math.sqrt(1 / 3)
    assert adv[:, 0].tolist() == pytest.approx([expect, -expect, -expect, expect])
    assert torch.equal(adv[:, 0:1].expand(4, 3), adv)  # same advantage on every token


def test_grpo_without_std_and_dr_grpo_subtract_the_mean_only():
    for est, kw in (("grpo", {"norm_std": False}), ("dr_grpo", {})):
        adv = compute_advantages(est, R1, MASK4, **kw)
        assert adv[:, 0].tolist() == [0.5, -0.5, -0.5, 0.5]


def test_rloo_uses_the_leave_one_out_mean():
    adv = compute_advantages("rloo", torch.tensor([[1.0, 0.0, 0.0, 3.0]]), MASK4)
    # sample 0: 1 - (0+0+3)/3 = 0; sample 1: 0 - 4/3; sample 3: 3 - 1/3
    assert adv[:, 0].tolist() == pytest.approx([0.0, -4 / 3, -4 / 3, 8 / 3])


def test_advantages_are_zero_on_padding():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    adv = compute_advantages("grpo", R1, mask)
    assert (adv[mask == 0] == 0).all()


def test_reinforce_plus_plus_returns_with_kl_then_batch_normalisation():
    rewards = torch.tensor([[1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.0, 0.1, 0.3]])
    adv = compute_advantages("reinforce_plus_plus", rewards, mask, token_kl=kl, kl_coef=0.5, eps=0.0)
    # per-token rewards: row0 [-.05, -.1 + 1, 0], row1 [0, -.05, -.15 + 0]; returns (gamma 1):
    ret = torch.tensor([[0.85, 0.9, 0.0], [-0.2, -0.2, -0.15]])
    valid = ret[mask.bool()]
    expect = (ret - valid.mean()) / valid.std() * mask
    assert torch.allclose(adv, expect, atol=1e-6)


def test_reinforce_plus_plus_baseline_subtracts_group_mean_first():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    mask = torch.ones(4, 1)
    adv = compute_advantages("reinforce_plus_plus_baseline", rewards, mask, eps=0.0)
    centred = torch.tensor([0.5, -0.5, 0.0, 0.0])
    assert adv[:, 0].tolist() == pytest.approx(((centred - centred.mean()) / centred.std()).tolist())


def test_unknown_estimator_and_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", R1, MASK4)
    with pytest.raises(ValueError, match="mask has 3 rows for 1 groups x 4 samples"):
        compute_advantages("grpo", R1, torch.ones(3, 2))


def test_kl_estimators_match_their_formulas():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    log_r = -0.5
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(log_r) - 1 - log_r)
    assert kl_penalty(ref, ref, "k3").item() == 0.0


def test_ppo_clip_asymmetric_and_dual_clip():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 5.0, 1.1]]))  # ratios 1.5, 0.5, 5.0, 1.1
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    mask = torch.ones(1, 4)
    cfg = PolicyLossConfig(eps_low=0.2, eps_high=0.28, aggregation="token-mean")
    loss, stats = policy_loss(logp, old, adv, mask, cfg)
    # token0 A>0: max(-1.5, -1.28) = -1.28; token1 A<0: max(0.5, 0.8) = 0.8;
    # token2 A<0: max(5.0, 1.28) = 5.0; token3: max(-1.1, -1.1) = -1.1
    assert loss.item() == pytest.approx((-1.28 + 0.8 + 5.0 - 1.1) / 4)
    assert stats["clip_frac"].item() == pytest.approx(2 / 4)
    dual = PolicyLossConfig(eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    loss_d, _ = policy_loss(logp, old, adv, mask, dual)
    assert loss_d.item() == pytest.approx((-1.28 + 0.8 + 3.0 - 1.1) / 4)  # token2 capped at -A*c = 3


def test_truncated_importance_sampling_weights_tokens():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.25, 0.5]]))  # weights 2 (capped at 1.5) and 1
    adv = torch.ones(1, 2)
    cfg = PolicyLossConfig(tis_cap=1.5)
    loss, stats = policy_loss(old.clone(), old, adv, torch.ones(1, 2), cfg, rollout_logp=rollout)
    assert loss.item() == pytest.approx((-1.5 - 1.0) / 2)
    assert stats["tis_weight"].item() == pytest.approx(1.25)


def test_aggregations():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(v, m, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(v, m, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(v, m, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    # Micro-batches with the full batch's normaliser add up to the full-batch loss.
    parts = aggregate(v[:1], m[:1], "token-mean", 4.0) + aggregate(v[1:], m[1:], "token-mean", 4.0)
    assert parts.item() == pytest.approx(10 / 4)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(v, m, "mean")
