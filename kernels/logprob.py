"""Fused log-prob and entropy of given tokens, with autograd, for vocabularies of 150k+.

    logprobs_entropy(logits, targets, temperature, group=..., vocab_start=..., valid=...)
    linear_logprobs_entropy(hidden, weight, targets, temperature, ...)

Both return (log p(target), entropy) in float32, shaped like `targets`. Neither materialises
the log-softmax: the forward keeps four float32 numbers per token (softmax statistics), the
backward recomputes the probabilities block by block. `linear_...` also never materialises the
logits of all tokens: it runs `chunk_tokens` rows of `hidden @ weight.T` at a time, in the
forward and again in the backward (one more matmul than the unfused path, for memory bounded
by one chunk). Its weight gradient accumulates in the weight's dtype, one rounding per chunk.

Vocabulary parallel (megatron's TP-sharded output layer): each rank passes its shard of the
logits (or of the weight), `vocab_start` (the shard's first token id) and `valid` (the shard's
columns that are real tokens: the last shard may hold padding), and the tensor-parallel `group`.
Per-token statistics are combined with three all-reduces of [tokens] vectors; the backward
needs no communication for the logits. For `linear_...` under TP the hidden-state gradient is
this shard's part: summing it over the group is the caller's (megatron's output layer does it).

Dispatch: the Triton kernels (triton_logprob.py) on CUDA; on CPU the plain torch reference
(reference.py), or with a group the same statistics computed with torch ops.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .reference import reference_linear_logprobs_entropy, reference_logprobs_entropy

CHUNK_BYTES = 1 << 30  # linear_...: rows per chunk such that one chunk of logits is <= 1 GiB


def logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    valid: int | None = None,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V(shard)], targets [...] (global token ids) -> (logp, entropy) [...], float32.
    `impl`: "triton" or "torch" (default: triton on CUDA, torch otherwise)."""
    impl = _impl(logits, impl)
    if impl == "torch" and group is None and valid in (None, logits.shape[-1]) and vocab_start == 0:
        return reference_logprobs_entropy(logits, targets, temperature)
    lead = targets.shape
    flat = logits.reshape(-1, logits.shape[-1])
    valid = flat.shape[1] if valid is None else valid
    logp, ent = _LogprobEntropy.apply(flat, targets.reshape(-1), 1.0 / temperature, vocab_start, valid, group, impl)
    return logp.view(lead), ent.view(lead)


def linear_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    valid: int | None = None,
    chunk_tokens: int | None = None,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [..., H], weight [V(shard), H] (the LM head), targets [...] -> (logp, entropy)."""
    impl = _impl(hidden, impl)
    if impl == "torch" and group is None and valid in (None, weight.shape[0]) and vocab_start == 0:
        return reference_linear_logprobs_entropy(hidden, weight, targets, temperature)
    lead = targets.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    valid = weight.shape[0] if valid is None else valid
    chunk = chunk_tokens or max(1, CHUNK_BYTES // max(1, weight.shape[0] * weight.element_size()))
    logp, ent = _LinearLogprobEntropy.apply(
        flat, weight, targets.reshape(-1), 1.0 / temperature, vocab_start, valid, group, impl, chunk
    )
    return logp.view(lead), ent.view(lead)


def _impl(t: torch.Tensor, impl: str | None) -> str:
    if impl is None:
        return "triton" if t.is_cuda else "torch"
    if impl not in ("triton", "torch"):
        raise ValueError(f"impl {impl!r}: expected triton or torch")
    return impl


# ---------------------------------------------------------------------- the two halves


def _stats(logits: torch.Tensor, local: torch.Tensor, valid: int, inv_temp: float, impl: str) -> torch.Tensor:
    """[4, rows]: max, sum exp(z - max), sum exp(z - max) z, z[target] (0 off this shard)."""
    if impl == "triton":
        from . import triton_logprob  # noqa: PLC0415 - triton is optional (CPU installs have none)

        return triton_logprob.stats(logits, local, valid, inv_temp)
    z = logits[:, :valid].float() * inv_temp
    m = z.max(-1).values if valid else torch.full((z.shape[0],), float("-inf"))
    e = torch.exp(z - m[:, None])
    here = (local >= 0) & (local < valid)
    t = torch.where(here, z.gather(1, local.clamp(0, max(valid - 1, 0))[:, None]).squeeze(1) if valid else 0.0, 0.0)
    return torch.stack([m, e.sum(-1), torch.where(e > 0, e * z, 0.0).sum(-1), t])


def _grad(
    logits: torch.Tensor,
    local: torch.Tensor,
    valid: int,
    inv_temp: float,
    lse: torch.Tensor,
    mean: torch.Tensor,
    glogp: torch.Tensor,
    gent: torch.Tensor,
    impl: str,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if impl == "triton":
        from . import triton_logprob  # noqa: PLC0415 - triton is optional (CPU installs have none)

        return triton_logprob.grad(
            logits, local, valid, inv_temp, lse, mean, glogp.float().contiguous(), gent.float().contiguous(), out
        )
    z = logits[:, :valid].float() * inv_temp
    p = torch.exp(z - lse[:, None])
    g = -p * (glogp[:, None] + gent[:, None] * (z - mean[:, None]))
    here = (local >= 0) & (local < valid)
    rows = torch.nonzero(here).squeeze(1)
    g[rows, local[rows]] += glogp[rows]
    full = torch.zeros_like(logits) if out is None else out.zero_()
    full[:, :valid] = (g * inv_temp).to(logits.dtype)
    return full


def _combine(st: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-shard statistics -> (logsumexp, E[z], z[target]) over the whole vocabulary."""
    m, s, w, t = st
    if group is not None:
        top = m.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        scale = torch.where(m == float("-inf"), 0.0, torch.exp(m - top))
        sums = torch.stack([s * scale, w * scale, t])
        dist.all_reduce(sums, group=group)
        m, (s, w, t) = top, sums
    return m + torch.log(s), w / s, t


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        inv_temp: float,
        vocab_start: int,
        valid: int,
        group: dist.ProcessGroup | None,
        impl: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        local = (targets - vocab_start).contiguous()
        lse, mean, t = _combine(_stats(logits, local, valid, inv_temp, impl), group)
        ctx.save_for_backward(logits, local, lse, mean)
        ctx.args = (inv_temp, valid, impl)
        return t - lse, lse - mean

    @staticmethod
    def backward(ctx: Any, glogp: torch.Tensor, gent: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, local, lse, mean = ctx.saved_tensors
        inv_temp, valid, impl = ctx.args
        glogp = torch.zeros_like(lse) if glogp is None else glogp
        gent = torch.zeros_like(lse) if gent is None else gent
        return _grad(logits, local, valid, inv_temp, lse, mean, glogp, gent, impl), None, None, None, None, None, None


class _LinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        inv_temp: float,
        vocab_start: int,
        valid: int,
        group: dist.ProcessGroup | None,
        impl: str,
        chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        local = (targets - vocab_start).contiguous()
        parts = [
            _stats(hidden[i : i + chunk] @ weight.t(), local[i : i + chunk], valid, inv_temp, impl)
            for i in range(0, hidden.shape[0], chunk)
        ]
        st = torch.cat(parts, dim=1) if parts else torch.zeros(4, 0, device=hidden.device)
        lse, mean, t = _combine(st, group)
        ctx.save_for_backward(hidden, weight, local, lse, mean)
        ctx.args = (inv_temp, valid, impl, chunk)
        return t - lse, lse - mean

    @staticmethod
    def backward(ctx: Any, glogp: torch.Tensor, gent: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, local, lse, mean = ctx.saved_tensors
        inv_temp, valid, impl, chunk = ctx.args
        glogp = torch.zeros_like(lse) if glogp is None else glogp
        gent = torch.zeros_like(lse) if gent is None else gent
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        for i in range(0, hidden.shape[0], chunk):
            h = hidden[i : i + chunk]
            logits = h @ weight.t()  # recomputed; its gradient is written over it
            g = _grad(
                logits,
                local[i : i + chunk],
                valid,
                inv_temp,
                lse[i : i + chunk],
                mean[i : i + chunk],
                glogp[i : i + chunk],
                gent[i : i + chunk],
                impl,
                out=logits,
            )
            if grad_h is not None:
                torch.mm(g, weight, out=grad_h[i : i + chunk])
            if grad_w is not None:
                grad_w.addmm_(g.t(), h)
        return grad_h, grad_w, None, None, None, None, None, None, None
