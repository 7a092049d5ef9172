"""Plain torch references: log-probs of given tokens and entropy, from logits or from hidden
states and the LM-head weight. They materialise the full log-softmax (in float32, or the input's
dtype when that is wider) and are what the Triton kernels are tested against (in float64)."""

from __future__ import annotations

import torch


def reference_logprobs_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V], targets [...] -> (log p(target), entropy), each [...], float32 or wider."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logsm = torch.log_softmax(z, dim=-1)
    logp = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    return logp, entropy


def reference_linear_logprobs_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [..., H] @ weight [V, H]^T, then `reference_logprobs_entropy`."""
    return reference_logprobs_entropy(hidden @ weight.t(), targets, temperature)
