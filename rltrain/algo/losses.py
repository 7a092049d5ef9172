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
- Rollout correction, for samples whose engine log-probs differ from the trainer's old ones (the
  engine's numerics, or weights a version or more behind: `loop.max_staleness`). With
  log rho_t = old_logp - rollout_logp on each response token (bounded to [-20, 20]):
  - importance weights (`is_level`): token, w_t = min(rho_t, C) (truncated IS: Yao et al. 2025,
    "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"); sequence,
    w = min(prod_t rho_t, C) at every token of the sequence. The weight multiplies the token's
    loss and carries no gradient.
  - rejection (`rs_level`, masked IS: Liu, Li et al. 2025, "When Speed Kills Stability"; IcePop,
    Ling team 2025): a token (token: rho_t), a whole sequence (sequence: prod_t rho_t; geometric:
    exp(mean_t log rho_t)) outside [lower, upper] leaves the loss, its gradient dropped.
  - veto (`veto`): a sequence with any rho_t below it leaves the loss.
  A rejected token still counts in the normaliser (the loss is the batch's token- or sequence-mean
  with that token's term 0, as IcePop's objective writes it): the micro-batches and the
  data-parallel ranks then still sum to the full batch's loss exactly.
- Aggregation: token-mean = sum(loss) / tokens; seq-mean-token-mean = mean over sequences of each
  sequence's token mean; seq-mean-token-sum = mean over sequences of each sequence's token sum
  (Dr. GRPO's unbiased form). Normalisers may be passed in so micro-batches and data-parallel
  ranks sum to exactly the full-batch loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
LOSSES = ("ppo", "cispo")
IMPORTANCE_LEVELS = ("token", "sequence")
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_LEVELS = ("token", "sequence", "geometric")
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
    tis_cap: float | None = None  # C: is_level="token", is_threshold=C (the older spelling)
    is_level: str | None = None  # rollout correction's importance weights: token or sequence (module doc)
    is_threshold: float = 2.0
    rs_level: str | None = None  # its rejection: token, sequence or geometric
    rs_upper: float = 2.0
    rs_lower: float = 0.5
    veto: float | None = None
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
    n = maskf.sum().clamp(min=1.0)
    stats = {
        "clip_frac": (clipped_mask.to(loss.dtype) * maskf).sum() / n,
        "approx_kl_old": (0.5 * token_log_ratio.pow(2) * maskf).sum() / n,
    }
    if cfg.tis_cap is not None or cfg.is_level is not None or cfg.rs_level is not None or cfg.veto is not None:
        if rollout_logp is None:
            raise ValueError(
                "rollout correction (importance weights or rejection) needs the engine's rollout log-probs"
            )
        weight, keep, more = rollout_correction(old_logp, rollout_logp, maskf, cfg)
        loss = loss * weight * keep
        stats.update(more)
    return aggregate(loss, mask, cfg.aggregation, normalizer), stats


def rollout_correction(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, maskf: torch.Tensor, cfg: PolicyLossConfig
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The importance weight and the kept-token mask [B, T] of rollout correction (module doc),
    neither with a gradient, and their statistics over the response tokens: the mean weight, the
    share of tokens whose weight was truncated, the share rejected (rejection and veto)."""
    level, threshold = cfg.is_level, cfg.is_threshold
    if cfg.tis_cap is not None:
        level, threshold = "token", cfg.tis_cap
    if level not in (None, *ROLLOUT_IS_LEVELS):
        raise ValueError(f"rollout IS level {level!r}; expected one of {', '.join(ROLLOUT_IS_LEVELS)}")
    if cfg.rs_level not in (None, *ROLLOUT_RS_LEVELS):
        raise ValueError(f"rollout rejection level {cfg.rs_level!r}; expected one of {', '.join(ROLLOUT_RS_LEVELS)}")
    with torch.no_grad():
        log_rho = ((old_logp - rollout_logp) * maskf).clamp(-20.0, 20.0)
        tokens = maskf.sum(dim=1, keepdim=True)
        seq_log_rho = log_rho.sum(dim=1, keepdim=True).clamp(-20.0, 20.0)
        n = maskf.sum().clamp(min=1.0)
        weight = torch.ones_like(maskf)
        stats: dict[str, torch.Tensor] = {}
        if level is not None:
            raw = torch.exp(log_rho) if level == "token" else torch.exp(seq_log_rho).expand_as(maskf)
            weight = raw.clamp(max=threshold)
            stats["is_truncated"] = ((raw > threshold).to(maskf.dtype) * maskf).sum() / n
        keep = torch.ones_like(maskf)
        if cfg.rs_level is not None:
            log_lo, log_hi = math.log(cfg.rs_lower), math.log(cfg.rs_upper)
            if cfg.rs_level == "token":
                judged = log_rho
            elif cfg.rs_level == "sequence":
                judged = seq_log_rho.expand_as(maskf)
            else:  # geometric: the per-token mean of the sequence's log-ratios
                judged = (log_rho.sum(dim=1, keepdim=True) / tokens.clamp(min=1.0)).expand_as(maskf)
            keep = ((judged >= log_lo) & (judged <= log_hi)).to(maskf.dtype)
        if cfg.veto is not None:
            vetoed = ((log_rho < math.log(cfg.veto)) & (maskf > 0)).any(dim=1, keepdim=True)
            keep = keep * (~vetoed).to(maskf.dtype)
        stats["is_weight"] = (weight * maskf).sum() / n
        stats["rs_rejected"] = ((1.0 - keep) * maskf).sum() / n
    return weight, keep, stats
