"""Config dtype names to torch dtypes, one rule for the trainer and the engine."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on a GPU, float32 on the CPU; otherwise the named dtype."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: expected auto, {', '.join(DTYPES)}") from None
