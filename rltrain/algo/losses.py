"""Policy, KL and entropy losses on per-token log-probs, with explicit aggregation.

All per-token tensors are [B, T] with `mask` 1 on response tokens.

- PPO clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7),
  with asymmetric clipping [1 - eps_low, 1 + eps_high] (Yu et al. 2025, "DAPO", "clip-higher") and
  dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with DRL", eq. 5): for A < 0
  the loss is capped at -A * c, c > 1, so a huge ratio on a bad action cannot dominate.
- KL estimators (Schulman 2020, "Approximating KL Divergence"), with log r = ref - logp:
  k1 = -log r = logp - ref;  k2 = (log r)^2 / 2;  k3 = (r - 1) - log r  (unbiased, always >= 0).
- GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", eqs. 5-7 and the GSPO-token
  form, eq. 13): `importance_level="sequence"` replaces each token's ratio by its sequence's
  length-normalised ratio s_i = exp(mean_t (logp - old_logp)), as the value sg[s_i] * pi/sg[pi]
  at every token: the value is s_i, the gradient of token t is s_i * grad log pi(y_t), and the
  clip (and dual clip) then act per sequence. The paper's clip range is small (3e-4 / 4e-4).
- CISPO (MiniMax 2025, "MiniMax-M1", eq. 4): `kind="cispo"`, a REINFORCE-style token loss
  -sg[clip(r_t, 1 - eps_low, 1 + eps_high)] * A * log pi(y_t): the importance weight is clipped
  and carries no gradient, so no token's gradient is dropped (PPO's clip zeroes it). MiniMax-M1
  bounds the weight above only (eps_low >= 1 leaves it unbounded below).
- Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training"): each token's loss is weighted by min(pi_old / pi_rollout, C), correcting
  for the rollout engine's numerics differing from the trainer's.
- Aggregation: token-mean = sum(loss) / tokens; seq-mean-token-mean = mean over sequences of each
  sequence's token mean; seq-mean-token-sum = mean over sequences of each sequence's token sum
  (Dr. GRPO's unbiased form). Normalisers may be passed in so micro-batches and data-parallel
  ranks sum to exactly the full-batch loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
LOSSES = ("ppo", "cispo")
IMPORTANCE_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    log_r = ref_logp - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.pow(2)
    if estimator == "k3":
        # Clamp before exp: a very unlikely token under the reference must not overflow.
        log_r = log_r.clamp(-20.0, 20.0)
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, normalizer: float | None = None) -> torch.Tensor:
    """Reduce per-token values to one loss. `normalizer`: tokens (token-mean) or sequences
    (seq-mean-*) of the whole batch; default: those of this tensor."""
    maskf = mask.to(values.dtype)
    if mode == "token-mean":
        total = normalizer if normalizer is not None else maskf.sum().clamp(min=1.0)
        return (values * maskf).sum() / total
    if mode == "seq-mean-token-sum":
        per_seq = (values * maskf).sum(dim=1)
    elif mode == "seq-mean-token-mean":
        per_seq = (values * maskf).sum(dim=1) / maskf.sum(dim=1).clamp(min=1.0)
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {', '.join(AGGREGATIONS)}")
    seqs = normalizer if normalizer is not None else max(values.shape[0], 1)
    return per_seq.sum() / seqs


@dataclass
class PolicyLossConfig:
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None  # c > 1 enables dual clip
    tis_cap: float | None = None  # C enables truncated importance sampling against engine log-probs
    aggregation: str = "token-mean"
    kind: str = "ppo"  # ppo (clipped surrogate) or cispo (clipped stop-gradient weight)
    importance_level: str = "token"  # token (PPO) or sequence (GSPO)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: PolicyLossConfig,
    rollout_logp: torch.Tensor | None = None,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss (PPO-clip or CISPO, token- or sequence-level ratio) and its statistics:
    clip fraction, approx KL to the old policy, TIS weight."""
    if cfg.kind not in LOSSES:
        raise ValueError(f"unknown policy loss {cfg.kind!r}; expected one of {', '.join(LOSSES)}")
    if cfg.importance_level not in IMPORTANCE_LEVELS:
        raise ValueError(f"importance_level={cfg.importance_level!r}; expected one of {', '.join(IMPORTANCE_LEVELS)}")
    maskf = mask.to(logp.dtype)
    token_log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    log_ratio = token_log_ratio
    if cfg.importance_level == "sequence":  # GSPO: the sequence's length-normalised log-ratio at every token
        seq = (log_ratio * maskf).sum(dim=1, keepdim=True) / maskf.sum(dim=1, keepdim=True).clamp(min=1.0)
        log_ratio = seq.detach() + logp - logp.detach()
    ratio = torch.exp(log_ratio)
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    if cfg.kind == "cispo":
        weight = ratio.detach().clamp(min=low, max=high)
        loss = -advantages * weight * logp
        clipped_mask = (ratio.detach() < low) | (ratio.detach() > high)
    else:
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(low, high)
        loss = torch.maximum(unclipped, clipped)
        clipped_mask = clipped > unclipped
        if cfg.dual_clip is not None:
            if cfg.dual_clip <= 1.0:
                raise ValueError(f"dual_clip={cfg.dual_clip}: must be > 1")
            capped = torch.minimum(loss, -advantages * cfg.dual_clip)
            loss = torch.where(advantages < 0, capped, loss)
    tis = None
    if cfg.tis_cap is not None:
        if rollout_logp is None:
            raise ValueError("truncated importance sampling needs the engine's rollout log-probs")
        tis = torch.exp((old_logp - rollout_logp).clamp(-20.0, 20.0)).clamp(max=cfg.tis_cap).detach()
        loss = loss * tis
    n = maskf.sum().clamp(min=1.0)
    stats = {
        "clip_frac": (clipped_mask.to(loss.dtype) * maskf).sum() / n,
        "approx_kl_old": (0.5 * token_log_ratio.pow(2) * maskf).sum() / n,
    }
    if tis is not None:
        stats["tis_weight"] = (tis * maskf).sum() / n
    return aggregate(loss, mask, cfg.aggregation, normalizer), stats
