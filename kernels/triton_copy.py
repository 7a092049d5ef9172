"""A copy made by the GPU's SMs (a kernel's loads and stores), not by a copy engine.

`sm_copy(dst, src)`: `dst`'s bytes become `src`'s, both contiguous, one of them may be
page-locked host memory (a kernel reads or writes it over the bus through its device mapping:
CUDA maps page-locked memory into the device's address space). `torch`'s `copy_` between host
and device hands the bytes to a copy engine instead.

Why (#52, `bench.hostcopy --after-free`): the trainer's onload copies right after the engine has
handed back tens of GiB run well below the pinned copy rate (51% on an H200 whose engine released
113 GiB; the same copy one second later runs at the full rate). If the driver's work on the freed
memory occupies the copy engines, a kernel's copy is not behind it. The benchmark measures both
ways right after a large free and at rest; the trainer's onload copies this way where
`RLTRAIN_ONLOAD_COPY=kernel` (trainer/host_park.py; a copy engine by default).

Each program copies BLOCK int32 words (bytes where the size is not a multiple of 4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # words per program


@triton.jit
def _copy_kernel(src_ptr: tl.tensor, dst_ptr: tl.tensor, n: tl.tensor, BLOCK: tl.constexpr) -> None:
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def sm_copy(dst: torch.Tensor, src: torch.Tensor, block: int = BLOCK) -> None:
    """`dst` <- `src` by a kernel (module doc): both contiguous, the same number of bytes."""
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("sm_copy: both tensors must be contiguous")
    d, s = dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
    if d.numel() != s.numel():
        raise ValueError(f"sm_copy: {s.numel()} bytes into {d.numel()}")
    if not d.numel():
        return
    aligned = d.numel() % 4 == 0 and d.data_ptr() % 4 == 0 and s.data_ptr() % 4 == 0
    if aligned:
        d, s = d.view(torch.int32), s.view(torch.int32)
    n = d.numel()
    _copy_kernel[(triton.cdiv(n, block),)](s, d, n, BLOCK=block)
