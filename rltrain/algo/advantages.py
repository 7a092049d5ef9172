"""Advantage estimators for outcome rewards.

Samples arrive grouped: `rewards` has shape [G, n] (G prompts, n samples each). Every
estimator returns per-token advantages [G * n, T] (zero on padding), because REINFORCE++ is
defined per token and the losses consume tokens.

- grpo (Shao et al. 2024, "DeepSeekMath", eq. in sec. 4.1.2): A_i = (r_i - mean(r)) / (std(r) + eps),
  std the unbiased sample std of the group; with `norm_std=False`, A_i = r_i - mean(r).
- dr_grpo (Liu et al. 2025, "Understanding R1-Zero-Like Training", sec. 3.1): A_i = r_i - mean(r):
  no std division (which over-weights near-solved and near-failed prompts); pair it with the
  "seq-mean-token-sum" aggregation, which drops the per-response length normaliser too.
- rloo (Ahmadian et al. 2024, "Back to Basics"): leave-one-out baseline,
  A_i = r_i - (sum_j r_j - r_i) / (n - 1).
- reinforce_plus_plus (Hu 2025, "REINFORCE++"): per-token reward -beta * KL_t, plus r at the last
  token; return G_t = sum_{s >= t} gamma^(s-t) r_s; then normalised over all valid tokens of the
  *global* batch: with `global_sum` (a sum over the data-parallel ranks) the mean and std are the
  whole batch's, so the result does not depend on the world size. `return_moments` gives a rank
  without samples the same collective to join.
- reinforce_plus_plus_baseline (same paper): r_i - mean(r) of the group first, then as above.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def compute_advantages(
    estimator: str,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    norm_std: bool = True,
    token_kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-6,
    global_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """rewards [G, n]; mask [G*n, T] (1 on response tokens); token_kl [G*n, T] for REINFORCE++."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {tuple(rewards.shape)}")
    G, n = rewards.shape
    if mask.shape[0] != G * n:
        raise ValueError(f"mask has {mask.shape[0]} rows for {G} groups x {n} samples")
    r = rewards.float()
    maskf = mask.float()
    if estimator in ("grpo", "dr_grpo", "rloo"):
        mean = r.mean(dim=1, keepdim=True)
        if estimator == "rloo":
            if n < 2:
                raise ValueError("rloo needs at least 2 samples per prompt")
            adv = r - (r.sum(dim=1, keepdim=True) - r) / (n - 1)
        elif estimator == "grpo" and norm_std:
            std = r.std(dim=1, keepdim=True) if n > 1 else torch.zeros_like(mean)
            adv = (r - mean) / (std + eps)
        else:
            adv = r - mean
        return adv.reshape(G * n, 1) * maskf
    if estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        if estimator == "reinforce_plus_plus_baseline":
            r = r - r.mean(dim=1, keepdim=True)
        per_token = torch.zeros_like(maskf)
        if token_kl is not None and kl_coef:
            per_token = per_token - kl_coef * token_kl.float() * maskf
        last = _last_index(mask)
        per_token[torch.arange(G * n), last] += r.reshape(-1)
        returns = torch.zeros_like(per_token)
        running = torch.zeros(G * n, dtype=per_token.dtype)
        for t in range(per_token.shape[1] - 1, -1, -1):
            running = per_token[:, t] + gamma * running * maskf[:, t]
            returns[:, t] = running
        mean, std = return_moments(returns[maskf.bool()], global_sum)
        return ((returns - mean) / (std + eps) * maskf).float()
    raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {', '.join(ESTIMATORS)}")


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13), added to the reward of a
    response of `lengths` tokens: 0 up to max_len - buffer, then falling linearly to -factor at
    max_len, and -factor beyond."""
    start = max_len - buffer
    over = (lengths.float() - start).clamp(min=0.0)
    return -factor * (over / max(buffer, 1)).clamp(max=1.0)


def return_moments(
    values: torch.Tensor, global_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased std of `values` (1-D), over every rank's values when `global_sum` sums
    a tensor over the ranks (each rank calls it once, also with no values)."""
    v = values.double()
    moments = torch.stack([torch.tensor(float(v.numel()), dtype=torch.float64), v.sum(), v.pow(2).sum()])
    if global_sum is not None:
        moments = global_sum(moments)
    count, total, squares = moments.tolist()
    mean = total / max(count, 1.0)
    var = (squares - count * mean * mean) / (count - 1) if count > 1 else 0.0
    return torch.tensor(mean), torch.tensor(max(var, 0.0) ** 0.5)


def _last_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last response token (rows must have at least one)."""
    lengths = mask.long().sum(dim=1)
    if (lengths == 0).any():
        raise ValueError("every sample needs at least one response token")
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=1).values
