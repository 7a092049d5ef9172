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
    assert stats["is_weight"].item() == pytest.approx(1.25) and stats["is_truncated"].item() == 0.5


def _two_sequences():
    """Two sequences of 3 response tokens (the second's last is padding), the trainer's old
    log-probs and the engine's: token ratios old/engine 2, 1, 0.5 and 1.25, 1.6, (pad)."""
    old = torch.log(torch.tensor([[0.4, 0.3, 0.2], [0.5, 0.4, 0.9]]))
    engine = torch.log(torch.tensor([[0.2, 0.3, 0.4], [0.4, 0.25, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return old, engine, mask


def test_rollout_correction_weights_and_rejects_as_each_level_defines():
    """Importance weights per token (truncated) and per sequence (the product of the ratios,
    truncated, at every token); rejection of tokens, of sequences by their product, or by their
    geometric mean; the veto of a sequence with a token ratio below it. No weight or mask has a
    gradient, padding is never weight nor rejected."""
    from rltrain.algo.losses import rollout_correction

    old, engine, mask = _two_sequences()

    def run(**kw):
        w, keep, stats = rollout_correction(old, engine, mask, PolicyLossConfig(**kw))
        assert not w.requires_grad and not keep.requires_grad
        return w * mask, keep * mask, {k: v.item() for k, v in stats.items()}

    w, keep, stats = run(is_level="token", is_threshold=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.0, 0.5], [1.25, 1.5, 0.0]]))
    assert keep.tolist() == mask.tolist() and stats["is_truncated"] == pytest.approx(2 / 5)
    assert stats["is_weight"] == pytest.approx((1.5 + 1 + 0.5 + 1.25 + 1.5) / 5) and stats["rs_rejected"] == 0
    w, _, _ = run(is_level="sequence", is_threshold=1.5)  # products 1.0 and 2.0 (truncated to 1.5)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 1.0], [1.5, 1.5, 0.0]]))
    _, keep, stats = run(rs_level="token", rs_upper=1.5, rs_lower=0.6)
    assert keep.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]] and stats["rs_rejected"] == pytest.approx(3 / 5)
    _, keep, _ = run(rs_level="sequence", rs_upper=1.5, rs_lower=0.6)  # products 1.0 (kept), 2.0 (out)
    assert keep.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    # Geometric means: 1.0 and sqrt(2) = 1.414: a bound of 1.4 rejects the second, 1.5 keeps both.
    assert run(rs_level="geometric", rs_upper=1.4, rs_lower=0.9)[1].tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert run(rs_level="geometric", rs_upper=1.5, rs_lower=0.9)[1].tolist() == mask.tolist()
    _, keep, stats = run(veto=0.6)  # the first sequence has a token at 0.5
    assert keep.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]] and stats["rs_rejected"] == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="rollout rejection level 'seq'"):
        run(rs_level="seq")


def test_rejected_tokens_carry_no_gradient_and_micro_batches_still_sum_to_the_batch_loss():
    """A token rejected by rollout correction adds nothing to the loss nor to its gradient; the
    normaliser is the batch's (a rejected token counts as a zero), so two micro-batches with the
    batch's normaliser sum to the whole batch's loss exactly."""
    old, engine, mask = _two_sequences()
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    cfg = PolicyLossConfig(is_level="token", is_threshold=1.5, rs_level="token", rs_upper=1.5, rs_lower=0.6)
    logp = old.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, old, adv, mask, cfg, rollout_logp=engine, normalizer=5.0)
    loss.backward()
    kept = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert (logp.grad[kept == 0] == 0).all() and (logp.grad[kept == 1] != 0).all()
    # Kept: token (0, 1), weight 1, A = 1, ratio 1 -> -1; token (1, 0), weight 1.25, A = -1 -> +1.25.
    assert loss.item() == pytest.approx((-1.0 + 1.25) / 5)
    halves = [
        policy_loss(old[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], cfg, engine[i : i + 1], 5.0)[0]
        for i in range(2)
    ]
    assert (halves[0] + halves[1]).item() == pytest.approx(loss.item())
    with pytest.raises(ValueError, match="needs the engine's rollout log-probs"):
        policy_loss(old, old, adv, mask, cfg)


def test_rollout_correction_settings_are_checked_when_the_config_is_read():
    from rltrain.config import AlgoConfig, ConfigError

    AlgoConfig(rollout_is="sequence", rollout_rs="geometric", rollout_rs_threshold=1.001).check()
    assert AlgoConfig(rollout_rs="token").rollout_rs_bounds == (2.0, 0.5)  # rollout_is_threshold, its reciprocal
    assert AlgoConfig(rollout_rs="token").corrects_rollout and not AlgoConfig().corrects_rollout
    for bad, why in [
        (dict(tis_cap=2.0, rollout_is="token"), "keep one"),
        (dict(rollout_rs="token", rollout_rs_threshold=0.9), r"expected 0 < lower <= 1 <= upper"),
        (dict(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=1.5), "lower <= 1"),
        (dict(rollout_token_veto_threshold=2.0), r"expected a ratio in \(0, 1\)"),
        (dict(rollout_is_threshold=0.0), "expected > 0"),
    ]:
        with pytest.raises(ConfigError, match=why):
            AlgoConfig(**bad).check()


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


def test_gspo_clips_the_length_normalised_sequence_ratio_and_each_token_gets_its_sequence_weight():
    """GSPO (Zheng et al. 2025): s_i = exp(mean_t log(pi / pi_old)) per sequence, clipped per
    sequence; d loss / d logp_t = -A_i s_i / N on every token of an unclipped sequence, 0 on a
    clipped one, whatever each token's own ratio."""
    old = torch.zeros(2, 3)
    # seq 0: token log-ratios .3, 0, 0 (mean .1 -> s = e^.1 ~ 1.105, inside [0.8, 1.2]);
    # seq 1: log-ratios .6, .6 and a padding token (mean .6 -> s = e^.6 ~ 1.82, clipped for A > 0).
    logp = torch.tensor([[0.3, 0.0, 0.0], [0.6, 0.6, 5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0], [1.0]]) * mask
    cfg = PolicyLossConfig(eps_low=0.2, eps_high=0.2, importance_level="sequence")
    loss, stats = policy_loss(logp, old, adv, mask, cfg)
    s0 = math.exp(0.1)  # seq 1's e^.6 is clipped to 1.2
    assert loss.item() == pytest.approx((3 * -s0 + 2 * -1.2) / 5, rel=1e-6)
    loss.backward()
    grad = logp.grad
    assert torch.allclose(grad[0], torch.full((3,), -s0 / 5), atol=1e-6)  # every token: its sequence's weight
    assert torch.equal(grad[1], torch.zeros(3))  # the clipped sequence: no gradient at all
    assert stats["clip_frac"].item() == pytest.approx(2 / 5)
    # Token level on the same numbers clips seq 0's first token (e^.3 > 1.2) and not the others.
    tok = logp.detach().clone().requires_grad_(True)
    policy_loss(tok, old, adv, mask, PolicyLossConfig(eps_low=0.2, eps_high=0.2))[0].backward()
    assert tok.grad[0, 0] == 0 and tok.grad[0, 1] != 0


def test_cispo_clips_a_stop_gradient_weight_and_keeps_every_tokens_gradient():
    """CISPO (MiniMax-M1): loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * logp_t, so a
    clipped token still has the gradient -w A / N (PPO's clip zeroes it)."""
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0]])).requires_grad_(True)  # ratios 1.5, 0.5, 1.0
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    cfg = PolicyLossConfig(eps_low=0.2, eps_high=0.28, kind="cispo")
    loss, stats = policy_loss(logp, old, adv, mask, cfg)
    w = [1.28, 0.8, 1.0]  # clipped weights
    lp = [math.log(1.5), math.log(0.5), 0.0]
    assert loss.item() == pytest.approx(sum(-w[i] * adv[0, i].item() * lp[i] for i in range(3)) / 3, rel=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.28 / 3, 0.8 / 3, -2.0 / 3]]), atol=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(2 / 3)
    ppo = logp.detach().clone().requires_grad_(True)
    policy_loss(ppo, old, adv, mask, PolicyLossConfig(eps_low=0.2, eps_high=0.28))[0].backward()
    assert ppo.grad[0, 0] == 0 and ppo.grad[0, 1] == 0  # what CISPO keeps, PPO drops


def test_the_soft_overlong_penalty_ramps_over_the_buffer():
    """DAPO eq. 13 with L_max 10, L_cache 4: 0 up to 6 tokens, then -(len - 6) / 4, -1 at 10."""
    from rltrain.algo.advantages import overlong_penalty

    got = overlong_penalty(torch.tensor([3, 6, 7, 8, 10]), max_len=10, buffer=4, factor=0.5)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))


def _reinforce_rank(rank: int, world_size: int, rewards, mask, kl) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")

    def total(t):
        dist.all_reduce(t)
        return t

    rows = slice(rank * 2, rank * 2 + 2)  # each rank holds one group of 2
    adv = compute_advantages(
        "reinforce_plus_plus", rewards[rank : rank + 1], mask[rows], token_kl=kl[rows], kl_coef=0.5, global_sum=total
    )
    dist.destroy_process_group()
    return {"adv": adv}


def test_reinforce_plus_plus_normalises_over_the_global_batch_on_real_ranks():
    """Two ranks of one group each give exactly the advantages of the whole batch in one place
    (per-rank normalisation would not: each rank's returns have their own mean and std)."""
    from multiproc import run_ranks, values

    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.0, 0.1, 0.3], [0.4, 0.0, 0.0], [0.2, 0.2, 0.2]])
    whole = compute_advantages("reinforce_plus_plus", rewards, mask, token_kl=kl, kl_coef=0.5)
    r0, r1 = values(run_ranks(_reinforce_rank, 2, rewards, mask, kl))
    assert torch.allclose(torch.cat([r0["adv"], r1["adv"]]), whole, atol=1e-6)
    alone = compute_advantages("reinforce_plus_plus", rewards[:1], mask[:2], token_kl=kl[:2], kl_coef=0.5)
    assert not torch.allclose(alone, whole[:2], atol=1e-3)


def test_dynamic_sampling_keeps_the_informative_groups_up_to_the_target_over_the_ranks():
    from rltrain.generation import Completion
    from rltrain.rollout.collect import Rollout, Sample, informative
    from rltrain.rollout.data import Prompt
    from rltrain.rollout.dynamic_sampling import keep_informative, quotas

    assert quotas([5, 5], 8) == [4, 4]  # even shares
    assert quotas([1, 9], 8) == [1, 7]  # a short rank's share goes to the other
    assert quotas([2, 3], 8) == [2, 3]  # the budget ran out: all there is
    assert quotas([4, 4, 4], 8) == [3, 3, 2]

    def group(*rewards):
        return [
            Sample(Prompt([1], {}), Completion(0, i, [2], finish_reason="stop"), reward=r)
            for i, r in enumerate(rewards)
        ]

    groups = [group(0.0, 0.0), group(1.0, 0.0), group(1.0, 1.0), group(0.0, 1.0), group(0.5, 0.0)]
    assert [informative(g) for g in groups] == [False, True, False, True, True]
    out = keep_informative(Rollout(groups, {}, groups), quota=2, batches=3)
    assert out.groups == [groups[1], groups[3]]
    assert out.stats["dynamic_groups_zero_advantage"] == 2 and out.stats["dynamic_groups_surplus"] == 1
    assert out.stats["dynamic_groups_kept"] == 2 and out.stats["dynamic_batches"] == 3
