"""Weight checksums both sides compute on the device, so a sync can be verified every step.

Per tensor: two integer sums over the tensor's bytes read as int32 words, plain and weighted by
position, computed in int64 with wrap-around. Integer addition is associative, so the result
does not depend on the reduction order (GPU or CPU, trainer or engine), and it runs at memory
bandwidth on the device without copying the weights to the host. The position weight catches
swapped elements. The model checksum hashes (name, dtype, shape, sums) of every tensor in name
order with xxh3. It is a check against lost, stale or mangled updates, not a cryptographic hash.
"""

from __future__ import annotations

from typing import Iterable

import torch
import xxhash

CHUNK = 1 << 24  # int32 words per step: bounds the int64 temporaries (128 MiB)


@torch.no_grad()
def tensor_sums(t: torch.Tensor) -> tuple[int, int]:
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-flat.numel()) % 4
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    words = flat.view(torch.int32)
    s1 = torch.zeros((), dtype=torch.int64, device=t.device)
    s2 = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), CHUNK):
        w = words[start : start + CHUNK].to(torch.int64)
        pos = torch.arange(start + 1, start + 1 + w.numel(), dtype=torch.int64, device=t.device)
        s1 += w.sum()
        s2 += (w * pos).sum()
    return int(s1), int(s2)


def combine(sums: dict[str, tuple[str, tuple[int, ...], tuple[int, int]]]) -> str:
    """name -> (dtype name, shape, tensor_sums) to one hex digest."""
    h = xxhash.xxh3_128()
    for name in sorted(sums):
        dtype, shape, (s1, s2) = sums[name]
        h.update(f"{name}|{dtype}|{list(shape)}|{s1}|{s2}\n".encode())
    return h.hexdigest()


def entry(t: torch.Tensor) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), tensor_sums(t)


def checksum(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> str:
    """Checksum of (name, tensor) pairs, each cast to `dtype` first (the receiver's dtype)."""
    return combine({n: entry(t if dtype is None else t.to(dtype)) for n, t in named})


class WeightMismatchError(RuntimeError):
    """The engine's weights after a sync differ from the trainer's."""
