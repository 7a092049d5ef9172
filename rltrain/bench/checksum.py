"""Benchmark: the weight checksums' one-launch kernel (kernels/triton_checksum.py) by block, chunk and warps.

    python -m rltrain.bench.checksum            # a GPU: 381 tensors of the 4B shape's sizes, 7.67 GB

Times `multi_block_sums` (median of 5, after a warm-up) over random int32 words in tensors of the
Qwen3-4B shape's sizes (embedding, MLP and attention matrices, norms), for each block size, chunk
(the words a program reads per step) and warp count, next to `torch.sum` over the same bytes (the
read's limit, measured in the same run); then `checksum.entries` as a sync calls it (its host
work included) at checksum.py's block and the kernel's defaults.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object]) -> float:
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - t0)
    return sorted(runs)[2]


def main() -> int:
    from rltrain.kernels.triton_checksum import CHUNK, WARPS, multi_block_sums
    from rltrain.weights.checksum import BLOCK, entries

    if not torch.cuda.is_available():
        raise SystemExit("rltrain.bench.checksum measures the GPU kernel: no CUDA device here")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    sizes = [151936 * 2560] + [2560 * 9728] * 108 + [2560 * 4096] * 72 + [2560] * 200  # bf16 elements
    ts = [torch.randint(-(2**31), 2**31 - 1, (n // 2,), dtype=torch.int32, device=dev, generator=g) for n in sizes]
    nbytes = sum(t.numel() * 4 for t in ts)
    x = torch.empty(nbytes // 4, dtype=torch.int32, device=dev)
    read = timed(lambda: torch.sum(x.view(torch.float32)))
    name = torch.cuda.get_device_name()
    print(f"# rltrain.bench.checksum  {time.strftime('%Y-%m-%d')}  torch {torch.__version__}  {name}")
    print(
        f"{len(ts)} tensors, {nbytes / 1e9:.2f} GB; torch.sum over the same bytes as float32: {read * 1e3:.2f} ms "
        f"({nbytes / read / 1e12:.2f} TB/s)"
    )
    for block in (8192, 16384, 32768, 65536):
        for chunk in (1024, 2048, 4096):
            for warps in (4, 8):
                s = timed(lambda: multi_block_sums(ts, block, warps, chunk))
                rate = nbytes / s / 1e12
                print(
                    f"block {block:5d} chunk {chunk:4d} warps {warps:2d}: {s * 1e3:6.2f} ms  {rate:.2f} TB/s  "
                    f"{read / s:4.0%} of the read"
                )
    named = [(f"w{i}", t) for i, t in enumerate(ts)]
    s = timed(lambda: entries(named))
    print(
        f"checksum.entries (block {BLOCK}, chunk {CHUNK}, {WARPS} warps, host work included): {s * 1e3:6.2f} ms  "
        f"{nbytes / s / 1e12:.2f} TB/s  {read / s:4.0%} of the read"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
