"""Triton kernels of the weight checksums' sums (weights/checksum.py) on a GPU.

`block_sums(words, block)`: for int32 `words`, one row per block of `block` words: the block's
plain sum and its sum weighted by the position inside the block (1-based), both int64 with
wrap-around. One read of the words, no int64 copy of them (the torch path widens each block of
rows before reducing it). Wrap-around inside a block is harmless: every sum is taken modulo
2**64, and checksum.py's `fold` (weighted = sum_b (b * block * plain_b + weighted_b)) is linear
modulo 2**64 too, so the folded sums do not depend on the block.

A program reads its block in chunks of `chunk` words, each lane keeping two int64 running sums
(its words, and the running sum's own running sum: the position weights without a multiply per
word, `_sums`), reduced once at the end: few registers per lane and many loads in flight, where
one load of the whole block held it all in registers. `multi_block_sums` does this for many tensors in one
launch: a table on the device gives each program (output row) its tensor in one load.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

CHUNK = 1024  # words a program reads per step of its loop (bench.checksum: the fastest on an H200)
WARPS = 4


@triton.jit
def _sums(base: tl.tensor, n: tl.tensor, start: tl.tensor, BLOCK: tl.constexpr, CHUNK: tl.constexpr) -> tuple:
    """(plain, weighted) sums of the words [start, start + BLOCK) of `base` (those below `n`).
    Lane j reads word c * CHUNK + j at step c = 0 .. K - 1 (K = BLOCK / CHUNK), adding it to
    its running sum and that running sum to a second one: then sum_c c * w_c = K * plain - tri,
    and the lane's weighted sum, positions c * CHUNK + j + 1, is CHUNK * (K * plain - tri) +
    (j + 1) * plain: no multiply per word."""
    pos = tl.arange(0, CHUNK)
    plain = tl.zeros((CHUNK,), dtype=tl.int64)
    tri = tl.zeros((CHUNK,), dtype=tl.int64)
    for c in tl.range(0, BLOCK, CHUNK):
        offs = start + c + pos
        plain += tl.load(base + offs, mask=offs < n, other=0).to(tl.int64)
        tri += plain
    weighted = CHUNK * ((BLOCK // CHUNK) * plain - tri) + (pos.to(tl.int64) + 1) * plain
    return tl.sum(plain, axis=0), tl.sum(weighted, axis=0)


@triton.jit
def _block_sums_kernel(
    words_ptr: tl.tensor, n: tl.tensor, out_ptr: tl.tensor, BLOCK: tl.constexpr, CHUNK: tl.constexpr
) -> None:
    pid = tl.program_id(0).to(tl.int64)
    plain, weighted = _sums(words_ptr, n, pid * BLOCK, BLOCK, CHUNK)
    tl.store(out_ptr + pid * 2, plain)
    tl.store(out_ptr + pid * 2 + 1, weighted)


def _chunk(block: int, chunk: int) -> int:
    if block & (block - 1) or chunk & (chunk - 1):
        raise ValueError(f"block ({block}) and chunk ({chunk}) must be powers of two")
    return min(block, chunk)


def block_sums(words: torch.Tensor, block: int, chunk: int = CHUNK, num_warps: int = WARPS) -> torch.Tensor:
    """[ceil(n / block), 2] int64 (plain, position-weighted) sums of each block of the contiguous
    1-D int32 `words` (`block` a power of two); no words: one zero row."""
    if words.dtype != torch.int32 or words.dim() != 1 or not words.is_contiguous():
        raise ValueError(f"block_sums takes contiguous 1-D int32 words, not {words.dtype} {tuple(words.shape)}")
    n = words.numel()
    blocks = max(1, triton.cdiv(n, block))
    out = torch.empty(blocks, 2, dtype=torch.int64, device=words.device)
    _block_sums_kernel[(blocks,)](words, n, out, BLOCK=block, CHUNK=_chunk(block, chunk), num_warps=num_warps)
    return out


@triton.jit
def _multi_block_sums_kernel(
    ptrs: tl.tensor,
    words: tl.tensor,
    row_start: tl.tensor,
    owner: tl.tensor,
    out_ptr: tl.tensor,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
) -> None:
    # Row `pid` of the output is block (pid - row_start[t]) of tensor t = owner[pid].
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(owner + pid)
    base = tl.load(ptrs + t).to(tl.pointer_type(tl.int32))
    start = (pid - tl.load(row_start + t)) * BLOCK
    plain, weighted = _sums(base, tl.load(words + t), start, BLOCK, CHUNK)
    tl.store(out_ptr + pid * 2, plain)
    tl.store(out_ptr + pid * 2 + 1, weighted)


def multi_block_sums(
    tensors: list[torch.Tensor], block: int, num_warps: int = WARPS, chunk: int = CHUNK
) -> list[torch.Tensor]:
    """`block_sums` of each tensor's bytes as int32 words, in one kernel launch for all of them:
    each tensor contiguous, on the same device, its address a multiple of 4 and its size a
    whole number of words. Returns each tensor's [ceil(words / block) or 1, 2] rows, views of
    one output (`multi_block_rows`)."""
    if not tensors:
        return []
    out, _, starts = _launch(tensors, block, num_warps, chunk)
    return list(out.split([b - a for a, b in zip(starts, starts[1:])]))


def multi_block_rows(
    tensors: list[torch.Tensor], block: int, num_warps: int = WARPS, chunk: int = CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """`multi_block_sums` as one [rows, 2] int64 output and, on the same device, the first row
    of each tensor (len(tensors) + 1 entries, the last the number of rows): nothing waits for the
    device. A table of addresses, sizes and first rows, and each row's tensor, tell each program
    what to read."""
    out, first, _ = _launch(tensors, block, num_warps, chunk)
    return out, first


def _launch(
    tensors: list[torch.Tensor], block: int, num_warps: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(output rows, first rows on the device, first rows on the host) of one launch over
    `tensors`: the tables travel to the device as one int64 array in one copy (from pinned
    memory on a GPU): addresses, sizes, first rows (len(tensors) + 1), each row's tensor."""
    device = tensors[0].device
    sizes, addresses = [], []
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not t.is_contiguous() or t.device != device or t.data_ptr() % 4 or nbytes % 4:
            raise ValueError(
                f"multi_block_sums takes contiguous, 4-byte aligned whole words on {device}, not "
                f"{t.dtype} {tuple(t.shape)} on {t.device}"
            )
        sizes.append(nbytes // 4)
        addresses.append(t.data_ptr())
    n = len(tensors)
    counts = np.maximum(1, -(-np.asarray(sizes, dtype=np.int64) // block))
    rows = int(counts.sum())
    host = np.empty(3 * n + 1 + rows, dtype=np.int64)
    host[:n], host[n : 2 * n], host[2 * n] = addresses, sizes, 0
    np.cumsum(counts, out=host[2 * n + 1 : 3 * n + 1])
    host[3 * n + 1 :] = np.repeat(np.arange(n, dtype=np.int64), counts)
    table = torch.from_numpy(host)
    table = table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table.to(device)
    first = table[2 * n : 3 * n + 1]
    out = torch.empty(rows, 2, dtype=torch.int64, device=device)
    _multi_block_sums_kernel[(rows,)](
        table[:n],
        table[n : 2 * n],
        first,
        table[3 * n + 1 :],
        out,
        BLOCK=block,
        CHUNK=_chunk(block, chunk),
        num_warps=num_warps,
    )
    return out, first, host[2 * n : 3 * n + 1].tolist()
