"""Triton kernel of seeded sampling's draw (engine/native/sampling.py): for each row, the argmax
of its (filtered) logits minus Gumbel noise that is a hash of (seed, step, token), in one pass
over the vocabulary.

The noise is the same function as `sampling.seeded_uniform` computes with torch ops (MurmurHash3's
finalizer in int64 arithmetic keeping 32 bits, then log(-log(u)) in float64, rounded to float32),
so the kernel picks the same token; it only never writes the [rows, vocab] noise out (the torch
ops make ~10 passes over it in int64). The row half of the hash (seed and step) is computed by the
caller; the vocabulary size is a compile-time constant (Triton 3.6's interpreter cannot loop to
a run-time bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _fmix32(h):
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@triton.jit
def _seeded_argmax_kernel(x_ptr, stride, row_hash_ptr, out_ptr, V: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.load(row_hash_ptr + row)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int64)
    for start in tl.range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V).to(tl.int64)
        inside = cols < V
        x = tl.load(x_ptr + row * stride + cols, mask=inside, other=float("-inf"))
        h = _fmix32(s ^ _fmix32((cols * 0x27D4EB2F) & 0xFFFFFFFF))
        u = (h.to(tl.float64) + 0.5) / 4294967296.0
        val = x - tl.log(-tl.log(u)).to(tl.float32)
        val = tl.where(inside, val, float("-inf"))
        better = val > best
        best = tl.where(better, val, best)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, best_idx, V), axis=0))


def seeded_argmax(x: torch.Tensor, row_hash: torch.Tensor) -> torch.Tensor:
    """x [rows, V] float32 (filtered logits / temperature), row_hash [rows] int64 -> tokens [rows]."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    _seeded_argmax_kernel[(x.shape[0],)](x, x.stride(0), row_hash.contiguous(), out, V=x.shape[1], BLOCK_V=BLOCK)
    return out
