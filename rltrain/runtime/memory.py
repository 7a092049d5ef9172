"""Giving memory back: to the CUDA driver and to the OS, after a phase has released its tensors."""

from __future__ import annotations

import ctypes

import torch

from rltrain.runtime import internals


def free_cuda_caches() -> None:
    """Return the caching allocator's free blocks to the driver, cuBLAS workspaces (allocated
    through the caching allocator) and blocks parked after CUDA IPC included."""
    if torch.cuda.is_available():
        internals.get("torch._C._cuda_clearCublasWorkspaces")()
        torch.cuda.ipc_collect()  # blocks shared by IPC that every consumer has let go of
    torch.cuda.empty_cache()


def trim_host_heap() -> None:
    """Give freed heap pages back to the OS (glibc keeps small freed blocks otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
