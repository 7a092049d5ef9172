"""Triton kernel of the weight checksums' sums (weights/checksum.py) on a GPU.

`block_sums(words, block)`: for int32 `words`, one row per block of `block` words: the block's
plain sum and its sum weighted by the position inside the block (1-based), both int64. One read
of the words, no int64 copy of them (the torch path widens each block of rows before reducing
it). A word's magnitude is at most 2**31 and a position at most `block` (4096 in checksum.py), so
a block's weighted sum stays below 2**55: no wrap-around inside the kernel. checksum.py's `fold`
adds the rows of every tensor up in a few torch ops, for all the tensors of a checksum together:
one kernel launch per tensor and a fixed handful more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_sums_kernel(words_ptr: tl.tensor, n: tl.tensor, out_ptr: tl.tensor, BLOCK: tl.constexpr) -> None:
    pid = tl.program_id(0).to(tl.int64)
    pos = tl.arange(0, BLOCK)
    offs = pid * BLOCK + pos
    w = tl.load(words_ptr + offs, mask=offs < n, other=0).to(tl.int64)
    plain = tl.sum(w, axis=0)
    local = tl.sum(w * (pos.to(tl.int64) + 1), axis=0)
    tl.store(out_ptr + pid * 2, plain)
    tl.store(out_ptr + pid * 2 + 1, local)


def block_sums(words: torch.Tensor, block: int) -> torch.Tensor:
    """[ceil(n / block), 2] int64 (plain, position-weighted) sums of each block of the contiguous
    1-D int32 `words` (`block` a power of two); no words: one zero row."""
    if words.dtype != torch.int32 or words.dim() != 1 or not words.is_contiguous():
        raise ValueError(f"block_sums takes contiguous 1-D int32 words, not {words.dtype} {tuple(words.shape)}")
    n = words.numel()
    blocks = max(1, triton.cdiv(n, block))
    out = torch.empty(blocks, 2, dtype=torch.int64, device=words.device)
    _block_sums_kernel[(blocks,)](words, n, out, BLOCK=block)
    return out
