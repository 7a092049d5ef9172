"""Triton kernels: per-row softmax statistics over a (shard of the) vocabulary, and the gradient
of (log-prob, entropy) with respect to the logits, both streaming over the vocabulary in blocks.

For z = logits / T over columns [0, valid) of a row (a shard of the vocabulary when it is split
over tensor-parallel ranks), `stats` returns per row, in float32:

    m = max z,  s = sum exp(z - m),  w = sum exp(z - m) * z,  t = z[target] (0 when the target
    is not in this shard)

from which logsumexp = m + log s, E = w / s, log p(target) = t - logsumexp and entropy =
logsumexp - E (shards combine first: logprob.py). `grad` writes, for upstream gradients gl
(log-prob) and gh (entropy):

    d/dlogits_j = (gl * [j == target] - p_j * (gl + gh * (z_j - E))) / T,   p_j = exp(z_j - lse)

Only [rows] vectors are kept; the full log-softmax never exists. The vocabulary sizes are
compile-time constants (one compilation per model; Triton 3.6's interpreter with numpy 2.4 also
cannot loop to a run-time bound). On CPU these run under Triton's
interpreter (TRITON_INTERPRET=1, set before triton is imported), which the tests use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _stats_kernel(
    logits_ptr: tl.tensor,
    stride: tl.tensor,
    targets_ptr: tl.tensor,
    inv_temp: tl.tensor,
    m_ptr: tl.tensor,
    s_ptr: tl.tensor,
    w_ptr: tl.tensor,
    t_ptr: tl.tensor,
    valid: tl.constexpr,
    BLOCK_V: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    # Per-lane running max / sums, reduced once at the end (no reduction per block).
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.full([BLOCK_V], 0.0, tl.float32)
    w = tl.full([BLOCK_V], 0.0, tl.float32)
    for start in tl.range(0, valid, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(base + cols, mask=cols < valid, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, z)
        keep = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
        e = tl.where(z == float("-inf"), 0.0, tl.exp(z - m_new))
        s = s * keep + e
        w = w * keep + tl.where(e > 0, e * z, 0.0)
        m = m_new
    top = tl.max(m, axis=0)
    scale = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
    tl.store(m_ptr + row, top)
    tl.store(s_ptr + row, tl.sum(s * scale, axis=0))
    tl.store(w_ptr + row, tl.sum(w * scale, axis=0))
    target = tl.load(targets_ptr + row)
    here = (target >= 0) & (target < valid)
    t = tl.load(base + tl.where(here, target, 0), mask=here, other=0.0).to(tl.float32) * inv_temp
    tl.store(t_ptr + row, tl.where(here, t, 0.0))


@triton.jit
def _grad_kernel(
    logits_ptr: tl.tensor,
    stride: tl.tensor,
    grad_ptr: tl.tensor,
    grad_stride: tl.tensor,
    targets_ptr: tl.tensor,
    inv_temp: tl.tensor,
    lse_ptr: tl.tensor,
    e_ptr: tl.tensor,
    gl_ptr: tl.tensor,
    gh_ptr: tl.tensor,
    valid: tl.constexpr,
    width: tl.constexpr,
    BLOCK_V: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    out = grad_ptr + row * grad_stride
    target = tl.load(targets_ptr + row)
    lse = tl.load(lse_ptr + row)
    mean = tl.load(e_ptr + row)
    gl = tl.load(gl_ptr + row)
    gh = tl.load(gh_ptr + row)
    for start in tl.range(0, width, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < valid
        z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp
        p = tl.where(mask, tl.exp(z - lse), 0.0)
        g = tl.where(p > 0, -p * (gl + gh * (z - mean)), 0.0)
        g = tl.where(cols == target, g + gl, g) * inv_temp
        tl.store(out + cols, g.to(grad_ptr.dtype.element_ty), mask=cols < width)


def stats(logits: torch.Tensor, targets: torch.Tensor, valid: int, inv_temp: float) -> torch.Tensor:
    """[4, rows] float32: m, s, w, t (see the module docstring). `targets` are shard-local."""
    rows = logits.shape[0]
    out = torch.empty(4, rows, dtype=torch.float32, device=logits.device)
    if rows:
        _stats_kernel[(rows,)](
            logits,
            logits.stride(0),
            targets,
            inv_temp,
            out[0],
            out[1],
            out[2],
            out[3],
            valid=valid,
            BLOCK_V=min(BLOCK, triton.next_power_of_2(max(valid, 16))),
            num_warps=8,
        )
    return out


def grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    valid: int,
    inv_temp: float,
    lse: torch.Tensor,
    mean: torch.Tensor,
    glogp: torch.Tensor,
    gent: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """d(loss)/d(logits) [rows, width] in `out` (may be `logits` itself: each element is read
    before it is written) or a new tensor of the logits' dtype; columns >= valid get 0."""
    rows, width = logits.shape
    out = torch.empty_like(logits) if out is None else out
    if rows:
        _grad_kernel[(rows,)](
            logits,
            logits.stride(0),
            out,
            out.stride(0),
            targets,
            inv_temp,
            lse,
            mean,
            glogp,
            gent,
            valid=valid,
            width=width,
            BLOCK_V=min(BLOCK, triton.next_power_of_2(max(width, 16))),
            num_warps=8,
        )
    return out
