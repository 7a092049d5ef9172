"""Triton kernel of the weight checksums' sums (weights/checksum.py) on a GPU.

`block_sums(words, block)`: for int32 `words`, one row per block of `block` words: the block's
plain sum and its sum weighted by the position inside the block (1-based), both int64. One read
of the words, no int64 copy of them (the torch path widens each block of rows before reducing
it). A word's magnitude is at most 2**31 and a position at most `block` (8192 in checksum.py), so
a block's weighted sum stays below 2**57: no wrap-around inside the kernel. checksum.py's `fold`
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


@triton.jit
def _multi_block_sums_kernel(
    ptrs: tl.tensor,
    words: tl.tensor,
    row_start: tl.tensor,
    tensors: tl.tensor,
    out_ptr: tl.tensor,
    BLOCK: tl.constexpr,
    STEPS: tl.constexpr,
) -> None:
    # Row `pid` of the output belongs to the tensor t with row_start[t] <= pid < row_start[t + 1]:
    # found by a binary search of STEPS halvings (2**STEPS >= the number of tensors).
    pid = tl.program_id(0).to(tl.int64)
    lo = tl.zeros((), dtype=tl.int64)
    hi = lo + tensors
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        right = tl.load(row_start + mid) <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    base = tl.load(ptrs + lo).to(tl.pointer_type(tl.int32))
    n = tl.load(words + lo)
    pos = tl.arange(0, BLOCK)
    offs = (pid - tl.load(row_start + lo)) * BLOCK + pos
    w = tl.load(base + offs, mask=offs < n, other=0).to(tl.int64)
    tl.store(out_ptr + pid * 2, tl.sum(w, axis=0))
    tl.store(out_ptr + pid * 2 + 1, tl.sum(w * (pos.to(tl.int64) + 1), axis=0))


def multi_block_sums(tensors: list[torch.Tensor], block: int, num_warps: int = 4) -> list[torch.Tensor]:
    """`block_sums` of each tensor's bytes as int32 words, in one kernel launch for all of them:
    each tensor contiguous, on the same device, its address a multiple of 4 and its size a
    whole number of words. Returns each tensor's [ceil(words / block) or 1, 2] rows, views of
    one output (`multi_block_rows`)."""
    if not tensors:
        return []
    out, _, starts = _launch(tensors, block, num_warps)
    return list(out.split([b - a for a, b in zip(starts, starts[1:])]))


def multi_block_rows(tensors: list[torch.Tensor], block: int, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """`multi_block_sums` as one [rows, 2] int64 output and, on the same device, the first row
    of each tensor (len(tensors) + 1 entries, the last the number of rows): nothing waits for the
    device. A table of addresses, sizes and first rows tells each program its tensor."""
    out, first, _ = _launch(tensors, block, num_warps)
    return out, first


def _launch(tensors: list[torch.Tensor], block: int, num_warps: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(output rows, first rows on the device, first rows on the host) of one launch over `tensors`."""
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
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + max(1, triton.cdiv(n, block)))
    table = torch.tensor([addresses, sizes, starts[:-1]], dtype=torch.int64)
    table = table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table.to(device)
    first = torch.tensor(starts, dtype=torch.int64)
    first = first.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else first.to(device)
    out = torch.empty(starts[-1], 2, dtype=torch.int64, device=device)
    steps = max(1, (len(tensors) - 1).bit_length())
    _multi_block_sums_kernel[(starts[-1],)](
        table[0], table[1], first, len(tensors), out, BLOCK=block, STEPS=steps, num_warps=num_warps
    )
    return out, first, starts
